"""Translation data plumbing: the split by English sentence, batching, tokenizer, `translate`,
BLEU and caching."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import sacrebleu
import torch
from torch import nn

from transformer_course import translation
from transformer_course.decoding import BOS, EOS, PAD, UNK, pad_batch, translate
from transformer_course.encoder_decoder import EncoderDecoderTransformer, Seq2SeqConfig
from transformer_course.tokenization import BPETokenizer
from transformer_course.training import History, compiled_blocks, save_checkpoint
from transformer_course.translation import (
    N_TEST,
    N_VALID,
    SETUPS,
    LengthBatches,
    corpus_bleu,
    first_sentences,
    is_trained,
    keep_short,
    load_splits,
    references_by_source,
    run_dir,
    seq2seq_loss,
    split_pairs,
    train_tokenizer,
)

TOY = [
    ("Go.", "Ve."),
    ("Go.", "Vete."),
    ("Hi.", "Hola."),
    ("Run!", "¡Corre!"),
    ("Run!", "¡Corran!"),
    ("Who?", "¿Quién?"),
    ("Wow!", "¡Órale!"),
    ("Fire!", "¡Fuego!"),
    ("Help!", "¡Ayuda!"),
    ("Stop!", "¡Para!"),
]


def test_split_keeps_every_source_sentence_in_one_split():
    splits = split_pairs(TOY, n_valid=2, n_test=3, seed=0)
    sources = {name: {e for e, _ in pairs} for name, pairs in splits.items()}
    assert len(sources["test"]) == 3 and len(sources["valid"]) == 2
    assert not sources["test"] & sources["train"] and not sources["valid"] & sources["train"]
    assert not sources["test"] & sources["valid"]
    assert sorted(p for pairs in splits.values() for p in pairs) == sorted(
        TOY
    )  # nothing lost or repeated
    assert split_pairs(TOY, n_valid=2, n_test=3, seed=0) == splits  # fixed seed, fixed split
    with pytest.raises(ValueError, match="n_valid \\+ n_test"):
        split_pairs(TOY, n_valid=4, n_test=4)
    with pytest.raises(ValueError, match="n_valid: expected an int >= 0, got -3"):
        split_pairs(TOY, n_valid=-3)  # would move test sentences into training


def test_real_split_sizes_and_no_test_sentence_in_training():
    splits = load_splits(max_words=1000)
    sources = {name: {e for e, _ in pairs} for name, pairs in splits.items()}
    assert len(sources["test"]) == N_TEST and len(sources["valid"]) == N_VALID
    assert not sources["test"] & sources["train"]
    assert sum(len(p) for p in splits.values()) == 118_964  # every Tatoeba pair, once


def test_keep_short_counts_words_on_both_sides():
    assert keep_short([("a b c", "x y"), ("a", "x y z w")], 3) == [("a b c", "x y")]


def test_tokenizer_has_the_special_tokens_and_round_trips():
    tokenizer = train_tokenizer(TOY * 5, 300)
    assert set(tokenizer.special_tokens) == {PAD, BOS, EOS, UNK}
    text = "¡Corre a la estación!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode(f"{BOS}Hola{EOS}")[0] == tokenizer.special_tokens[BOS]


def test_batches_group_similar_lengths_and_depend_only_on_the_step():
    tokenizer = train_tokenizer(TOY * 5, 300)
    batches = LengthBatches(tokenizer, TOY, 3, seed=1)
    src, tgt_in, tgt_out = batches(0)
    pad, bos, eos = (tokenizer.special_tokens[t] for t in (PAD, BOS, EOS))
    assert (tgt_in[:, 0] == bos).all()
    # Teacher forcing: the decoder input is the output shifted right by one.
    for row_in, row_out in zip(tgt_in.tolist(), tgt_out.tolist()):
        real_out = [t for t in row_out if t != pad]
        assert real_out[-1] == eos and [t for t in row_in if t != pad] == [bos] + real_out[:-1]
    for step in range(8):
        assert all(
            torch.equal(a, b)
            for a, b in zip(batches(step), LengthBatches(tokenizer, TOY, 3, seed=1)(step))
        )
    seen = sorted(i for step in range(len(batches)) for i in batches.batches[step])
    assert seen == list(range(len(TOY)))  # one epoch covers every pair once
    lengths = [len(batches.examples[i][0]) for b in batches.batches for i in b]
    assert lengths == sorted(lengths)


def test_bleu_uses_every_reference():
    sources, references = references_by_source(TOY)
    assert references[sources.index("Run!")] == ["¡Corre!", "¡Corran!"]
    hypotheses = ["el gato negro duerme en casa", "tengo dos perros muy grandes"]
    refs = [
        ["el gato negro duerme", "el gato negro duerme en casa"],
        ["tengo dos perros muy grandes"],
    ]
    expected = sacrebleu.corpus_bleu(
        hypotheses,
        [
            ["el gato negro duerme", "tengo dos perros muy grandes"],
            ["el gato negro duerme en casa", None],
        ],
    )
    assert corpus_bleu(hypotheses, refs).score == pytest.approx(expected.score)
    assert corpus_bleu(hypotheses, refs).score == pytest.approx(
        100.0
    )  # each hypothesis matches one reference
    assert corpus_bleu(hypotheses, refs, multi_reference=False).score < 100.0


def test_cache_folder_changes_with_the_settings():
    quick = SETUPS["quick"]
    assert run_dir(quick) == run_dir(replace(quick))
    assert run_dir(quick) != run_dir(replace(quick, max_steps=quick.max_steps + 1))
    assert run_dir(quick).name.startswith("quick-")


def test_is_trained_reads_the_cached_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_COURSE_RUNS", str(tmp_path))
    setup = replace(SETUPS["quick"], max_steps=10)
    assert run_dir(setup).is_relative_to(tmp_path) and not is_trained(setup)
    run_dir(setup).mkdir(parents=True)
    for step, done in ((4, False), (10, True)):
        save_checkpoint(run_dir(setup) / "checkpoint.pt", nn.Linear(2, 1), None, step, History())
        assert is_trained(setup) is done
    (run_dir(setup) / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="checkpoint.pt: cannot be read"):
        is_trained(setup)


def test_buckets_pad_to_a_few_lengths_without_changing_the_loss():
    tokenizer = train_tokenizer(TOY * 5, 300)
    plain = LengthBatches(tokenizer, TOY, 3, seed=1)
    bucketed = LengthBatches(tokenizer, TOY, 3, seed=1, buckets=(4, 8, 16))
    pad = tokenizer.special_tokens[PAD]
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size
    cfg = Seq2SeqConfig(
        src_vocab=vocab,
        tgt_vocab=vocab,
        d_model=16,
        n_heads=2,
        n_layers=1,
        d_mlp=32,
        dropout=0.0,
        max_len=32,
        pad_id=pad,
    )
    model = EncoderDecoderTransformer(cfg).eval()
    for step in range(len(plain)):
        short, long = plain(step), bucketed(step)
        for a, b in zip(short, long):
            assert b.shape[1] in (4, 8, 16) and b.shape[1] >= a.shape[1]
            assert torch.equal(b[:, : a.shape[1]], a) and (b[:, a.shape[1] :] == pad).all()
        with torch.no_grad():
            expected = seq2seq_loss(model, short, pad_id=pad)
            actual = seq2seq_loss(model, long, pad_id=pad)
            torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)
    assert bucketed.distinct_shapes() <= plain.distinct_shapes()
    with pytest.raises(ValueError, match=r"buckets: expected increasing positive ints, got \(8, 4"):
        LengthBatches(tokenizer, TOY, 3, buckets=(8, 4))
    with pytest.raises(ValueError, match="buckets: the largest, 2, is shorter than a batch's"):
        LengthBatches(tokenizer, TOY, 3, buckets=(1, 2))(0)


def test_compiled_blocks_need_one_graph_per_kind_of_block_and_are_eager_after():
    """The full profile's regional compilation: the same losses and gradients as eager, no graph
    break, and a few graphs for any number of layers and lengths."""
    graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs) -> Callable:
        graphs.append(graph)
        return graph.forward  # run as traced: this test checks the graphs, not the kernels

    torch.manual_seed(0)
    cfg = Seq2SeqConfig(
        src_vocab=50, tgt_vocab=50, d_model=16, n_heads=2, n_layers=3, d_mlp=32, dropout=0.0,
        max_len=32, pad_id=0,
    )  # fmt: skip
    model = EncoderDecoderTransformer(cfg)
    eager = EncoderDecoderTransformer(cfg)
    eager.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    blocks = [*model.encoder, *model.decoder]
    with compiled_blocks(blocks, backend=backend, fullgraph=True):
        for src_len, tgt_len in ((5, 7), (9, 4), (12, 12), (3, 6), (16, 9)):
            src = torch.randint(1, 50, (4, src_len), generator=generator)
            tgt = torch.randint(1, 50, (4, tgt_len + 1), generator=generator)
            src[0, -2:], tgt[1, -3:] = 0, 0  # padding in both
            batch = (src, tgt[:, :-1], tgt[:, 1:])
            losses = [seq2seq_loss(m, batch) for m in (model, eager)]
            for loss in losses:
                loss.backward()
            torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=0)
            for p, q in zip(model.parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
                p.grad = q.grad = None
    torch._dynamo.reset()
    # an encoder block, a decoder block, and one more where both sides had one length
    assert 2 <= len(graphs) <= 3, f"{len(graphs)} graphs"
    assert not any("forward" in vars(block) for block in blocks)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--beam-size", "0"], "--beam-size: expected an int >= 1, got 0"),
        (["--max-steps", "-1"], "--max-steps: expected an int >= 0, got -1"),
        (["--max-words", "0"], "--max-words: expected an int >= 1, got 0"),
        (["--test-sentences", "0"], "--test-sentences: expected an int >= 1, got 0"),
    ],
)
def test_cli_refuses_bad_settings_before_any_work(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(translation, "run_translation", lambda *a, **k: pytest.fail("it trained"))
    with pytest.raises(SystemExit) as exit_:
        translation.main(["--profile", "quick", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_cache_folder_that_is_a_file_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRANSFORMER_COURSE_RUNS", str(tmp_path))
    run_dir(SETUPS["quick"]).parent.mkdir(parents=True)
    run_dir(SETUPS["quick"]).write_text("not a folder")
    monkeypatch.setattr(translation, "load_splits", lambda *a: pytest.fail("work started"))
    with pytest.raises(ValueError, match="checkpoint_dir: expected a directory"):
        translation.run_translation(SETUPS["quick"])


def test_pad_batch_pads_on_the_right_to_the_longest():
    assert pad_batch([[5, 6, 7], [8], [9, 10]], 0).tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]


def _translation_setup():
    tokenizer = BPETokenizer.train("hola mundo " * 5, 270, special_tokens=["<pad>", "<s>", "</s>"])
    vocab, pad = tokenizer.vocab_size, tokenizer.special_tokens["<pad>"]
    cfg = Seq2SeqConfig(
        src_vocab=vocab,
        tgt_vocab=vocab,
        d_model=16,
        n_heads=4,
        n_layers=2,
        d_mlp=24,
        dropout=0.0,
        max_len=32,
        pad_id=pad,
    )
    model = EncoderDecoderTransformer(cfg)
    return model, tokenizer


def test_translate_refuses_bad_settings_instead_of_guessing():
    model, tokenizer = _translation_setup()
    with pytest.raises(ValueError, match=r"max_new_tokens: expected an int >= 1 and <= 32, got 0"):
        translate(model, ["hello"], tokenizer, max_new_tokens=0)
    with pytest.raises(ValueError, match="batch_size: expected a positive int, got 0"):
        translate(model, ["hello"], tokenizer, batch_size=0)
    plain = BPETokenizer.train("hello", 260)
    with pytest.raises(ValueError, match=r"src_tokenizer: expected the .* missing \[.</s>.\]"):
        translate(model, ["hello"], plain, tokenizer)
    with pytest.raises(ValueError, match=r"tgt_tokenizer: .* missing \['<s>', '</s>'\]"):
        translate(model, ["hello"], tokenizer, plain)
    assert len(translate(model, ["hello", "hola"], tokenizer, max_new_tokens=3)) == 2
    with pytest.warns(DeprecationWarning, match="max_len is deprecated: call it max_new_tokens"):
        assert len(translate(model, ["hello"], tokenizer, max_len=3)) == 1
    with pytest.raises(TypeError, match="max_len: the former name of max_new_tokens"):
        translate(model, ["hello"], tokenizer, max_len=3, max_new_tokens=3)


def test_first_sentences_keeps_every_reference_of_the_first_n():
    pairs = [("A.", "a1"), ("B.", "b1"), ("A.", "a2"), ("C.", "c1"), ("B.", "b2")]
    assert first_sentences(pairs, 2) == [("A.", "a1"), ("B.", "b1"), ("A.", "a2"), ("B.", "b2")]
    assert first_sentences(pairs, None) == pairs
    assert first_sentences(pairs, 10) == pairs
