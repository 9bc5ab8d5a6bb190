"""English → Spanish translation on Tatoeba: data split, tokenizer and special tokens, batches
and the teacher-forcing loss, `translate` from strings to strings, training and BLEU.

The split is made **by English sentence**: Tatoeba often lists several Spanish translations of
one English sentence, and all of them go to the same split, so no test source sentence is ever
seen in training. Source and target share one byte-level BPE vocabulary (trained on the training
split only): the two languages share the Latin alphabet and many subwords (names, numbers,
"hotel", "-ción"/"-tion"), and one vocabulary lets a single embedding matrix serve the encoder,
the decoder and the output layer.

Run the quick profile from the command line (CPU, a few minutes):

    python -m transformer_course.translation --profile quick

With `--max-steps 1 --max-words 3 --test-sentences 2` it checks the whole pipeline in seconds:
one step, on sentences of at most 3 words, and BLEU on 2 test sentences.

Trained models are cached under `runs/translation/<profile>-<hash of the settings>/`, so the book
reuses a finished run instead of training again (and resumes an interrupted one).

On a GPU every new batch shape costs kernel selection and attention plans (cuDNN builds one in
2-3 s), so the full profile pads each batch's lengths up to a few fixed `length_buckets`: the
shapes repeat, and a handful of plans serve the whole run. The quick profile (CPU) pads each
batch only to its longest sentence: there, padding costs compute and plans cost nothing.

Eager, a full-profile step launches about 2,600 small kernels and leaves the GPU mostly idle,
so the full profile also trains with its blocks compiled (`training.compiled_blocks`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import sacrebleu
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer_course import validate
from transformer_course.attention import set_fast_path
from transformer_course.data import load_translation_pairs
from transformer_course.decoding import (
    BOS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    pad_batch,
    translate,
)
from transformer_course.encoder_decoder import (
    EncoderDecoderTransformer,
    Seq2SeqConfig,
    label_smoothed_cross_entropy,
)
from transformer_course.runtime import evaluating, get_device, get_profile
from transformer_course.tokenization import GPT2_SPLIT_PATTERN, BPETokenizer
from transformer_course.training import (
    CHECKPOINT_NAME,
    History,
    TrainConfig,
    compiled_blocks,
    read_checkpoint,
    train,
)

SentencePair = tuple[str, str]  # (English, Spanish)
SPLIT_SEED = 2017
N_VALID, N_TEST = 1000, 2000  # English sentences (each with all its translations)
SAMPLE_SENTENCES = ("I don't know what to do.", "Where is the train station?", "She has two cats.")
# SDPA's kernels for this model's masked attention, chosen rather than left to the dispatcher:
# on an H100 cuDNN's attention cost 1.7 ms of CPU per call and a 2-3 s plan per new batch shape.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class TranslationSetup:
    """Data, model and training sizes for one profile.

    Course: chapter 5.
    """

    name: str
    max_words: int  # keep pairs whose sentences both have at most this many words
    vocab_size: int  # shared BPE vocabulary, special tokens included
    d_model: int
    n_heads: int
    n_layers: int
    d_mlp: int
    dropout: float
    batch_size: int  # sentence pairs per step
    max_steps: int
    lr: float  # peak of the inverse-square-root schedule
    warmup_steps: int
    label_smoothing: float = 0.1
    eval_every: int = 200
    seed: int = 0
    length_buckets: tuple[int, ...] = ()  # pad lengths up to these (empty: to each batch's longest)
    compile: bool = False  # train with the blocks compiled (for a GPU: a CPU compiles C++ slowly)


SETUPS = {
    "quick": TranslationSetup(
        name="quick",
        max_words=6,
        vocab_size=2000,
        d_model=96,
        n_heads=4,
        n_layers=2,
        d_mlp=384,
        dropout=0.0,  # in 1,000 steps, dropout 0.1 slowed learning down
        batch_size=64,
        max_steps=1000,
        lr=2e-3,
        warmup_steps=150,
        eval_every=250,
    ),
    "full": TranslationSetup(
        name="full",
        max_words=30,
        vocab_size=8000,
        d_model=512,
        n_heads=8,
        n_layers=6,
        d_mlp=2048,
        dropout=0.1,
        batch_size=512,
        max_steps=2500,
        lr=1e-3,
        warmup_steps=800,
        eval_every=500,
        length_buckets=(8, 12, 16, 24, 32, 48, 64, 136),
        compile=True,
    ),
}


# Data ----------------------------------------------------------------------------------------


def split_pairs(
    pairs: Sequence[SentencePair],
    *,
    n_valid: int = N_VALID,
    n_test: int = N_TEST,
    seed: int = SPLIT_SEED,
) -> dict[str, list[SentencePair]]:
    """Split into train/valid/test by English sentence: all translations of one sentence stay
    together.

    Course: chapter 5.
    """
    validate.integer("n_valid", n_valid, low=0)
    validate.integer("n_test", n_test, low=0)
    by_source: dict[str, list[SentencePair]] = defaultdict(list)
    for english, spanish in pairs:
        by_source[english].append((english, spanish))
    sources = sorted(by_source)
    if n_valid + n_test >= len(sources):
        raise ValueError(
            f"n_valid + n_test: expected fewer than {len(sources)} distinct sources, "
            f"got {n_valid + n_test}"
        )
    random.Random(seed).shuffle(sources)
    parts = {
        "test": sources[:n_test],
        "valid": sources[n_test : n_test + n_valid],
        "train": sources[n_test + n_valid :],
    }
    return {name: [pair for s in chosen for pair in by_source[s]] for name, chosen in parts.items()}


def keep_short(pairs: Sequence[SentencePair], max_words: int) -> list[SentencePair]:
    """Pairs whose English and Spanish sentences have at most `max_words` words each.

    Course: chapter 5.
    """
    return [(e, s) for e, s in pairs if len(e.split()) <= max_words and len(s.split()) <= max_words]


def load_splits(max_words: int) -> dict[str, list[SentencePair]]:
    """Tatoeba English–Spanish, split by English sentence, then restricted to short sentences.

    Course: chapter 5.
    """
    splits = split_pairs(load_translation_pairs("spa-eng"))
    return {name: keep_short(pairs, max_words) for name, pairs in splits.items()}


def train_tokenizer(pairs: Sequence[SentencePair], vocab_size: int) -> BPETokenizer:
    """One byte-level BPE vocabulary for both languages, learned from the training pairs only.

    Course: chapter 5.
    """
    text = "\n".join(f"{english}\n{spanish}" for english, spanish in pairs)
    return BPETokenizer.train(
        text, vocab_size, pattern=GPT2_SPLIT_PATTERN, special_tokens=SPECIAL_TOKENS
    )


def references_by_source(pairs: Sequence[SentencePair]) -> tuple[list[str], list[list[str]]]:
    """Distinct English sentences and, for each, every Spanish translation in `pairs`.

    Course: chapter 5.
    """
    grouped: dict[str, list[str]] = defaultdict(list)
    for english, spanish in pairs:
        grouped[english].append(spanish)
    sources = list(grouped)
    return sources, [grouped[s] for s in sources]


def first_sentences(pairs: Sequence[SentencePair], n: int | None) -> list[SentencePair]:
    """The pairs whose English sentence is among the first `n` distinct ones (every pair when
    `n` is None): a smaller test set that keeps every reference of each sentence it keeps.

    Course: chapter 5.
    """
    if n is None:
        return list(pairs)
    kept = set(references_by_source(pairs)[0][:n])
    return [pair for pair in pairs if pair[0] in kept]


def seq2seq_loss(
    model: nn.Module,
    batch: tuple[Tensor, Tensor, Tensor],
    *,
    smoothing: float = 0.1,
    pad_id: int = 0,
) -> Float[Tensor, ""]:
    """Teacher forcing: feed `<s> y1 .. yn`, predict `y1 .. yn </s>`; label-smoothed, padding
    ignored.

    Course: chapter 5.
    """
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    return label_smoothed_cross_entropy(logits, tgt_out, smoothing=smoothing, ignore_index=pad_id)


class LengthBatches:
    """`batches(step) -> (src, tgt_in, tgt_out)`: batches of pairs of similar length, in a
    seeded order.

    Grouping similar lengths wastes little compute on padding. With `buckets` (increasing
    lengths), each batch is padded further, up to the smallest bucket that holds it, so only a
    few shapes ever occur. The batch for a step depends only on the step (and the seed), so a
    resumed run sees exactly the data it would have seen.

    Course: chapter 5.
    """

    def __init__(
        self,
        tokenizer: BPETokenizer,
        pairs: Sequence[SentencePair],
        batch_size: int,
        *,
        seed: int = 0,
        device="cpu",
        buckets: Sequence[int] = (),
    ):
        ints = all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in buckets)
        if not ints or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets: expected increasing positive ints, got {tuple(buckets)}")
        self.pad, self.bos, self.eos = (tokenizer.special_tokens[t] for t in (PAD, BOS, EOS))
        self.examples = [(tokenizer.encode(e) + [self.eos], tokenizer.encode(s)) for e, s in pairs]
        order = sorted(
            range(len(self.examples)),
            key=lambda i: (len(self.examples[i][0]), len(self.examples[i][1]), i),
        )
        self.batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        self.seed, self.device, self.buckets = seed, device, tuple(buckets)

    def __len__(self) -> int:
        return len(self.batches)

    def padded_length(self, length: int) -> int:
        """The smallest bucket that holds `length` (the length itself without buckets)."""
        k = bisect_left(self.buckets, length)
        if not self.buckets:
            return length
        if k == len(self.buckets):
            largest = self.buckets[-1]
            raise ValueError(f"buckets: the largest, {largest}, is shorter than a batch's {length}")
        return self.buckets[k]

    def shapes(self, indices: Sequence[int]) -> tuple[int, int, int]:
        """(rows, source length, target length) of the batch of `indices`, padding included."""
        src = max(len(self.examples[i][0]) for i in indices)
        tgt = max(len(self.examples[i][1]) for i in indices) + 1  # bos + tokens, tokens + eos
        return len(indices), self.padded_length(src), self.padded_length(tgt)

    def batch(self, indices: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        _, src_len, tgt_len = self.shapes(indices)
        rows = (
            [self.examples[i][0] for i in indices],
            [[self.bos] + self.examples[i][1] for i in indices],
            [self.examples[i][1] + [self.eos] for i in indices],
        )
        padded = [
            F.pad(pad_batch(r, self.pad), (0, n - max(map(len, r))), value=self.pad)
            for r, n in zip(rows, (src_len, tgt_len, tgt_len))
        ]
        # One host-to-device copy (asynchronous from pinned memory) instead of three.
        stacked = torch.cat(padded, dim=1)
        if torch.device(self.device).type == "cuda":
            stacked = stacked.pin_memory().to(self.device, non_blocking=True)
        return stacked.split([src_len, tgt_len, tgt_len], dim=1)

    def distinct_shapes(self) -> int:
        """How many different batch shapes one epoch produces."""
        return len({self.shapes(indices) for indices in self.batches})

    def __call__(self, step: int) -> tuple[Tensor, Tensor, Tensor]:
        epoch, k = divmod(step, len(self.batches))
        order = torch.randperm(
            len(self.batches), generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        )
        return self.batch(self.batches[order[k]])


def model_config(setup: TranslationSetup, tokenizer: BPETokenizer) -> Seq2SeqConfig:
    """The model for `setup`: one vocabulary, one embedding matrix for both sides and the output.

    Course: chapter 5.
    """
    return Seq2SeqConfig(
        src_vocab=tokenizer.vocab_size,
        tgt_vocab=tokenizer.vocab_size,
        d_model=setup.d_model,
        n_heads=setup.n_heads,
        n_layers=setup.n_layers,
        d_mlp=setup.d_mlp,
        dropout=setup.dropout,
        n_ctx=4 * setup.max_words + 16,
        pad_id=tokenizer.special_tokens[PAD],
        share_embeddings=True,
        tie_embeddings=True,
    )


# Evaluation ----------------------------------------------------------------------------------


def mean_loss(
    model: EncoderDecoderTransformer, batches: LengthBatches, *, smoothing: float = 0.0
) -> float:
    """Token-weighted mean cross-entropy over every batch of `batches` (no label smoothing by
    default).

    Course: chapter 5.
    """
    total, count = 0.0, 0
    with evaluating(model):
        for indices in batches.batches:
            batch = batches.batch(indices)
            tokens = (batch[2] != batches.pad).sum()
            total = (
                total + seq2seq_loss(model, batch, smoothing=smoothing, pad_id=batches.pad) * tokens
            )
            count = count + tokens
    return (total / count).item()  # one host synchronisation for the whole set


def translate_test(
    model: EncoderDecoderTransformer,
    tokenizer: BPETokenizer,
    pairs: Sequence[SentencePair],
    *,
    beam_size: int = 1,
) -> tuple[list[str], list[str], list[list[str]]]:
    """Translate each distinct English sentence of `pairs`: (sources, hypotheses, references).
    On a GPU, 512 sentences at a time (a decoding step costs about as much for 512 as for 64,
    the batch on a CPU).

    Course: chapter 5.
    """
    sources, references = references_by_source(pairs)
    batch_size = 512 if next(model.parameters()).is_cuda else 64
    hypotheses = translate(model, sources, tokenizer, beam_size=beam_size, batch_size=batch_size)
    return sources, hypotheses, references


def corpus_bleu(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]], *, multi_reference: bool = True
) -> sacrebleu.metrics.bleu.BLEUScore:
    """sacrebleu corpus BLEU; `references[i]` lists every accepted translation of sentence `i`.

    With `multi_reference` every Spanish translation Tatoeba lists counts (as in Papineni et al.'s
    multi-reference BLEU); otherwise only the first one does.

    Course: chapter 5.
    """
    if not multi_reference:
        references = [refs[:1] for refs in references]
    width = max(len(refs) for refs in references)
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]
    return sacrebleu.corpus_bleu(list(hypotheses), streams)


# Training with a cache -----------------------------------------------------------------------


def runs_root() -> Path:
    """Where trained models are cached: `$TRANSFORMER_COURSE_RUNS`, else `runs/` at the
    repository root.

    Course: chapter 5.
    """
    if os.environ.get("TRANSFORMER_COURSE_RUNS"):
        return Path(os.environ["TRANSFORMER_COURSE_RUNS"])
    root = Path(__file__).resolve().parents[2]
    return (root if (root / "pyproject.toml").exists() else Path.cwd()) / "runs"


def run_dir(setup: TranslationSetup) -> Path:
    """The run's folder, named by the profile and a hash of every setting that changes the
    trained model (and of the format of what is saved there).

    Course: chapter 5.
    """
    # The format changes when saved models stop loading (2: the encoder's and decoder's blocks
    # became the one TransformerBlock, whose parameters are named differently).
    settings = {**asdict(setup), "split": [SPLIT_SEED, N_VALID, N_TEST], "format": 2}
    del settings["compile"]  # the same model, computed faster
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return runs_root() / "translation" / f"{setup.name}-{digest[:12]}"


def is_trained(setup: TranslationSetup) -> bool:
    """True if the cache holds a model of `setup` trained to its last step.

    Course: chapter 5.
    """
    path = run_dir(setup) / CHECKPOINT_NAME
    return path.exists() and read_checkpoint(path)["step"] >= setup.max_steps


@dataclass
class TranslationRun:
    """What `run_translation` returns: the trained model and everything needed to use it.

    Course: chapter 5.
    """

    setup: TranslationSetup
    model: EncoderDecoderTransformer
    tokenizer: BPETokenizer
    splits: dict[str, list[SentencePair]]
    history: History
    train_seconds: float  # 0 when everything came from the cache


def train_config(
    setup: TranslationSetup, *, progress: bool = True, log_every: int = 50
) -> TrainConfig:
    """The training settings for `setup` (validated as a whole when built).

    Course: chapter 5.
    """
    return TrainConfig(
        max_steps=setup.max_steps,
        lr=setup.lr,
        warmup_steps=setup.warmup_steps,
        lr_schedule="inverse_sqrt",
        betas=(0.9, 0.98),
        weight_decay=0.0,
        grad_clip=1.0,
        eval_every=setup.eval_every,
        log_every=log_every,
        checkpoint_every=setup.eval_every,
        checkpoint_dir=run_dir(setup),
        seed=setup.seed,
        progress=progress,
    )


def cached_tokenizer(setup: TranslationSetup, pairs: Sequence[SentencePair]) -> BPETokenizer:
    """The run's tokenizer: loaded from its folder, else trained on `pairs` and saved there.

    Course: chapter 5.
    """
    path = run_dir(setup) / "tokenizer.json"
    if path.exists():
        return BPETokenizer.load(path)
    tokenizer = train_tokenizer(pairs, setup.vocab_size)
    tokenizer.save(path)  # atomically: the cache never holds half a tokenizer
    return tokenizer


def run_translation(
    setup: TranslationSetup,
    *,
    progress: bool = True,
    log_every: int = 50,
    samples: Sequence[str] = SAMPLE_SENTENCES,
    on_log: Callable[[dict[str, float]], None] | None = None,
) -> TranslationRun:
    """Train (or load from the cache, or resume) the model for `setup`; print sample
    translations as it goes.

    Course: chapter 5.
    """
    device = get_device()
    cfg = train_config(setup, progress=progress, log_every=log_every)  # refused before any work
    splits = load_splits(setup.max_words)
    tokenizer = cached_tokenizer(setup, splits["train"])
    torch.manual_seed(setup.seed)
    model = EncoderDecoderTransformer(model_config(setup, tokenizer)).to(device)
    set_fast_path(model, True)
    sizes = dict(device=device, buckets=setup.length_buckets)
    pairs = splits["train"]
    train_batches = LengthBatches(tokenizer, pairs, setup.batch_size, seed=setup.seed, **sizes)
    valid_batches = LengthBatches(tokenizer, splits["valid"], 256, **sizes)
    if progress:
        shapes, n = train_batches.distinct_shapes(), len(train_batches)
        print(f"{shapes} distinct batch shapes in an epoch of {n} batches", flush=True)

    @torch.compiler.set_stance("force_eager")  # new graphs for a few batches would cost more
    def evaluate(model: EncoderDecoderTransformer) -> dict[str, float]:
        if progress and samples:
            for source, output in zip(samples, translate(model, list(samples), tokenizer)):
                print(f"    {source} → {output}", flush=True)
        return {"valid_loss": mean_loss(model, valid_batches)}

    def loss(model: EncoderDecoderTransformer, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        return seq2seq_loss(model, batch, smoothing=setup.label_smoothing, pad_id=train_batches.pad)

    started = time.perf_counter()
    blocks = [*model.encoder, *model.decoder]
    compiling = compiled_blocks(blocks) if setup.compile else nullcontext()
    with sdpa_kernel(ATTENTION_BACKENDS), compiling:
        history = train(model, cfg, train_batches, loss, evaluate=evaluate, on_log=on_log)
    seconds = time.perf_counter() - started
    set_fast_path(model, False)
    model.eval()
    return TranslationRun(setup, model, tokenizer, splits, history, seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of `main`, every value checked before any work starts."""
    parser = argparse.ArgumentParser(
        description="Train the English→Spanish Transformer and report test BLEU."
    )
    parser.add_argument("--profile", choices=sorted(SETUPS), default=get_profile())
    parser.add_argument(
        "--max-steps", type=int, help="override the profile's number of training steps"
    )
    parser.add_argument(
        "--beam-size", type=int, default=4, help="beam size for the BLEU evaluation (1 = greedy)"
    )
    parser.add_argument(
        "--threads", type=int, help="CPU threads for PyTorch (1 is fastest on a busy machine)"
    )
    parser.add_argument(
        "--max-words",
        type=int,
        help="override the profile's longest sentence, in words (fewer words: fewer pairs)",
    )
    parser.add_argument(
        "--test-sentences",
        type=int,
        help="score BLEU on the test split's first N English sentences only (default: all); "
        "with --max-steps 1 and --max-words 3, a run of seconds that checks the whole pipeline",
    )
    args = parser.parse_args(argv)
    limits = {"--max-steps": (args.max_steps, 0), "--beam-size": (args.beam_size, 1)}
    limits["--threads"] = (args.threads, 1)
    limits["--max-words"] = (args.max_words, 1)
    limits["--test-sentences"] = (args.test_sentences, 1)
    for flag, (value, low) in limits.items():
        if value is not None and value < low:
            parser.error(f"{flag}: expected an int >= {low}, got {value}")
    overrides = {"max_steps": args.max_steps, "max_words": args.max_words}
    args.setup = replace(
        SETUPS[args.profile],
        **{name: value for name, value in overrides.items() if value is not None},
    )
    try:
        train_config(args.setup)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m transformer_course.translation`: train (or load) a profile, report test BLEU.

    Course: chapter 5.
    """
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    setup = args.setup
    print(f"profile {setup.name}: {setup}")
    machine = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    print(f"device {get_device()} | {machine} | {os.cpu_count()} CPUs | torch threads {threads}")
    run = run_translation(setup)
    n_params = sum(p.numel() for p in run.model.parameters())
    print(
        f"{n_params / 1e6:.2f}M parameters; {len(run.splits['train'])} training pairs; "
        f"training took {run.train_seconds:.0f}s (0 = loaded from {run_dir(setup)})"
    )
    test = first_sentences(run.splits["test"], args.test_sentences)
    n_sentences = len(references_by_source(run.splits["test"])[0])
    part = ""
    if args.test_sentences is not None and args.test_sentences < n_sentences:
        part = f", first {args.test_sentences} of {n_sentences} sentences"
    for beam in sorted({1, args.beam_size}):
        started = time.perf_counter()
        _, hypotheses, references = translate_test(run.model, run.tokenizer, test, beam_size=beam)
        multi = corpus_bleu(hypotheses, references)
        single = corpus_bleu(hypotheses, references, multi_reference=False)
        print(
            f"test BLEU (beam {beam}{part}): {multi.score:.1f} with all references, "
            f"{single.score:.1f} with one reference [{multi}] "
            f"({time.perf_counter() - started:.0f}s)"
        )


if __name__ == "__main__":
    main()
