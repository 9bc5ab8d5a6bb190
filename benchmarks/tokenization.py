"""Speed of the course's BPE: training and encoding against Hugging Face and tiktoken.

Part 1, GPT-2's real tokenizer (OpenAI's `encoder.json` and `vocab.bpe`): the course's
`load_gpt2_tokenizer()` (and the same tables without `tokens_encode_whole`, which merge every new
chunk), tiktoken and Hugging Face's `GPT2TokenizerFast`, each built from the same two files,
encode all of wikitext-2 (valid and test) from a cold start: a freshly built tokenizer per round,
so no cache carries over. It asserts identical ids and reports each one's time as a
ratio to tiktoken's (the course aims for at most 3x), plus the time to build each from the files.

Part 2, training: both tokenizers are byte-level BPE with GPT-2's regex pre-split, trained on
all of Tiny Shakespeare to the same vocabulary size (4096 by default). The script reports, as
medians of `--repeats` rounds with the implementations alternating so machine load hits both alike:

* training time, and ours / HF (the course aims for at most 10x);
* encoding throughput of the whole text in MB/s, starting from an empty per-chunk cache, and
  ours / HF (the course aims for at least 1 MB/s);
* bytes per token of both on the same text.

Hugging Face runs on `--threads` threads (default 1, a like-for-like comparison with Python).
`--max-chars N` keeps only the first N characters of each text, for a quick run (a few seconds
with `--max-chars 20000 --vocab-size 512 --repeats 1`); the README's figures use whole texts.

Usage: python benchmarks/tokenization.py [--vocab-size 4096] [--repeats 5] [--threads 1]
                                         [--gpt2-only] [--max-chars N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def truncated(max_chars: int | None) -> str:
    return "" if max_chars is None else f" (first {max_chars:,} characters)"


def gpt2_files(repeats: int, max_chars: int | None = None) -> None:
    """Encode wikitext-2 with GPT-2's files: the course against tiktoken and Hugging Face."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from transformers import GPT2TokenizerFast

    from transformer_course.data import fetch, load_text
    from transformer_course.tokenization import BPETokenizer, load_gpt2_tokenizer
    from transformer_course.tokenizer_files import read_gpt2_files

    encoder_json, vocab_bpe = str(fetch("gpt2", "encoder.json")), str(fetch("gpt2", "vocab.bpe"))
    # tiktoken_ext/openai_public.py, gpt2(): OpenAI's pre-split regex
    pat_str = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    builders = {
        "course": load_gpt2_tokenizer,
        # the same tables without tokens_encode_whole: every new chunk goes through the merges
        "course, merging every chunk": lambda: BPETokenizer(
            **read_gpt2_files(encoder_json, vocab_bpe)
        ),
        "tiktoken": lambda: tiktoken.Encoding(
            "gpt2",
            pat_str=pat_str,
            special_tokens={"<|endoftext|>": 50256},
            mergeable_ranks=data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json),
        ),
        "HF fast": lambda: GPT2TokenizerFast(vocab=encoder_json, merges=vocab_bpe),
    }
    encoders = {
        "course": lambda tok, text: tok.encode(text),
        "course, merging every chunk": lambda tok, text: tok.encode(text),
        "tiktoken": lambda tok, text: tok.encode_ordinary(text),
        "HF fast": lambda tok, text: tok(text)["input_ids"],
    }
    text = (load_text("wikitext-2-valid") + load_text("wikitext-2-test"))[:max_chars]
    n_bytes = len(text.encode("utf-8"))
    build: dict[str, list[float]] = {name: [] for name in builders}
    encode: dict[str, list[float]] = {name: [] for name in builders}
    ids = {}
    for _ in range(repeats):
        for name, make in builders.items():  # alternate, so machine load hits all alike
            seconds, tok = timed(make)
            build[name].append(seconds)
            seconds, ids[name] = timed(encoders[name], tok, text)
            encode[name].append(seconds)
        for name in builders:
            assert ids[name] == ids["tiktoken"], f"{name} ids differ from tiktoken's"
    base = statistics.median(encode["tiktoken"])
    print(
        f"GPT-2's files, wikitext-2 valid + test{truncated(max_chars)}: {n_bytes:,} bytes, "
        f"{len(ids['tiktoken']):,} tokens, identical ids; median of {repeats}, fresh tokenizers"
    )
    for name in builders:
        seconds = statistics.median(encode[name])
        built = statistics.median(build[name])
        print(
            f"  {name:<27} encode {seconds:5.2f} s ({n_bytes / seconds / 1e6:5.2f} MB/s) = "
            f"{seconds / base:5.2f}x tiktoken's time; build from files {built:5.2f} s"
        )
    print("  goal: course <= 3x tiktoken's time")


def training(vocab_size: int, repeats: int, threads: int, max_chars: int | None = None) -> None:
    """Train on Tiny Shakespeare and encode it: the course against Hugging Face `tokenizers`."""
    import tokenizers
    from tokenizers import pre_tokenizers, trainers

    from transformer_course.data import load_text
    from transformer_course.tokenization import GPT2_SPLIT_PATTERN, BPETokenizer

    text = load_text("tinyshakespeare")[:max_chars]
    n_bytes = len(text.encode("utf-8"))

    def train_hf() -> tokenizers.Tokenizer:
        hf = tokenizers.Tokenizer(tokenizers.models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator([text], trainer)
        return hf

    times: dict[str, list[float]] = {name: [] for name in ("train ours", "train hf", "ours", "hf")}
    for _ in range(repeats):
        seconds, ours = timed(BPETokenizer.train, text, vocab_size, pattern=GPT2_SPLIT_PATTERN)
        times["train ours"].append(seconds)
        seconds, hf = timed(train_hf)
        times["train hf"].append(seconds)
        fresh = BPETokenizer(  # an empty cache
            ours.vocab, ours.merges, pattern=GPT2_SPLIT_PATTERN, tokens_encode_whole=True
        )
        seconds, ids_ours = timed(fresh.encode, text)
        times["ours"].append(seconds)
        fresh_hf = tokenizers.Tokenizer.from_str(hf.to_str())  # an empty cache
        seconds, ids_hf = timed(lambda: fresh_hf.encode(text).ids)  # noqa: B023 (called here)
        times["hf"].append(seconds)
    median = {name: statistics.median(values) for name, values in times.items()}

    print(
        f"Tiny Shakespeare{truncated(max_chars)}, {n_bytes:,} bytes; vocab {vocab_size}; "
        f"median of {repeats}; HF threads {threads}"
    )
    train_ours, train_hf_s = median["train ours"], median["train hf"]
    print(
        f"train   ours {train_ours:6.2f} s   HF {train_hf_s:6.2f} s   "
        f"ours/HF {train_ours / train_hf_s:5.1f}x   (goal <= 10x)"
    )
    mb_ours, mb_hf = n_bytes / median["ours"] / 1e6, n_bytes / median["hf"] / 1e6
    print(
        f"encode  ours {mb_ours:6.2f} MB/s  HF {mb_hf:6.2f} MB/s  "
        f"ours/HF {mb_ours / mb_hf:5.2f}    (goal: ours >= 1 MB/s)"
    )
    print(f"bytes per token   ours {n_bytes / len(ids_ours):.3f}   HF {n_bytes / len(ids_hf):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="threads for Hugging Face")
    parser.add_argument("--gpt2-only", action="store_true", help="only part 1, GPT-2's real files")
    parser.add_argument(
        "--max-chars", type=int, help="only the first N characters of each text (a quick run)"
    )
    args = parser.parse_args()
    for flag, value in (("--repeats", args.repeats), ("--max-chars", args.max_chars)):
        if value is not None and value < 1:
            parser.error(f"{flag}: expected an int >= 1, got {value}")
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # read when tokenizers starts its pool

    gpt2_files(args.repeats, args.max_chars)
    if not args.gpt2_only:
        training(args.vocab_size, args.repeats, args.threads, args.max_chars)


if __name__ == "__main__":
    main()
