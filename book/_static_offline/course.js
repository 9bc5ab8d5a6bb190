// Every figure of a page links to its image at full size, so a plot shown at a third of its
// width on a phone can be opened and read (Sphinx links only the images it scales itself).
document.addEventListener("DOMContentLoaded", () => {
  for (const img of document.querySelectorAll(".bd-article img")) {
    if (img.closest("a")) {
      continue;
    }
    const link = document.createElement("a");
    link.href = img.src;
    link.className = "full-size";
    link.title = "Open the figure at full size";
    img.replaceWith(link);
    link.appendChild(img);
  }
});
