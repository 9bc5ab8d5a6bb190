"""Greedy decoding and beam search: where they stop, what they return, what they refuse."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

# Helpers shared with the model's reference tests (pytest puts tests/ on sys.path).
from test_encoder_decoder import BOS, EOS, PAD, batch_with_padding, small_config

from transformer_course.decoding import beam_search, greedy_decode
from transformer_course.encoder_decoder import EncoderDecoderTransformer, Seq2SeqConfig


class Scripted(EncoderDecoderTransformer):
    """A model whose next token is fixed by the target length: tokens 5, 6, 7, ... then `eos_at`."""

    def __init__(self, eos_at: int):
        super().__init__(small_config())
        self.eos_at = eos_at

    def decode(self, tgt, memory, src_mask):
        logits = torch.full((*tgt.shape, self.cfg.tgt_vocab), -10.0)
        for pos in range(tgt.shape[1]):
            logits[:, pos, EOS if pos + 1 == self.eos_at else 5 + pos % 10] = 10.0
        return logits


def test_decoding_stops_at_the_end_token_and_respects_max_len():
    src = torch.tensor([[5, 6], [7, PAD]])
    for decode in (greedy_decode, beam_search):
        assert (
            decode(Scripted(eos_at=4), src, bos_id=BOS, eos_id=EOS, max_new_tokens=10)
            == [[5, 6, 7]] * 2
        )
        assert (
            decode(Scripted(eos_at=99), src, bos_id=BOS, eos_id=EOS, max_new_tokens=6)
            == [[5, 6, 7, 8, 9, 10]] * 2
        )
        assert decode(Scripted(eos_at=1), src, bos_id=BOS, eos_id=EOS, max_new_tokens=6) == [[], []]


def test_beam_one_equals_greedy():
    torch.manual_seed(4)
    model = EncoderDecoderTransformer(small_config()).double()
    src = torch.randint(3, 23, (6, 7))
    src[2, 4:] = PAD
    greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=12)
    assert beam_search(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=12, beam_size=1) == greedy
    assert all(len(row) <= 12 and EOS not in row and BOS not in row for row in greedy)


def test_beam_search_finds_a_better_sequence_than_greedy():
    # Hand-built two-step problem: greedy takes token 5 (p=0.6) then faces a flat distribution;
    # token 6 (p=0.4) leads to a certain end. Beam 2 must prefer 6 -> eos (0.4) over 5 -> x -> ... .
    class TwoPaths(EncoderDecoderTransformer):
        def __init__(self):
            super().__init__(small_config())

        def decode(self, tgt, memory, src_mask):
            logits = torch.full((*tgt.shape, self.cfg.tgt_vocab), -30.0)
            last = tgt[:, -1]
            for row, token in enumerate(last.tolist()):
                if token == BOS:
                    logits[row, -1, 5], logits[row, -1, 6] = math.log(0.6), math.log(0.4)
                elif token == 6:
                    logits[row, -1, EOS] = 0.0
                else:
                    logits[row, -1, 3:] = 0.0  # uniform over 16 tokens, eos never likely
            return logits

    src = torch.tensor([[5]])
    assert greedy_decode(TwoPaths(), src, bos_id=BOS, eos_id=EOS, max_new_tokens=3)[0][0] == 5
    assert beam_search(TwoPaths(), src, bos_id=BOS, eos_id=EOS, max_new_tokens=3, beam_size=2) == [
        [6]
    ]


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_special_ids_outside_the_vocabulary_are_refused(decode):
    """An eos_id the model cannot emit would make every row run on to max_len."""
    model = EncoderDecoderTransformer(small_config())
    src, _ = batch_with_padding()
    with pytest.raises(ValueError, match=r"eos_id: expected an int id in \[0, 19\), got 19"):
        decode(model, src, bos_id=BOS, eos_id=19, max_new_tokens=5)
    with pytest.raises(ValueError, match=r"bos_id: expected an int id in \[0, 19\), got -1"):
        decode(model, src, bos_id=-1, eos_id=EOS, max_new_tokens=5)
    with pytest.raises(ValueError, match=r"eos_id: .* got True"):
        decode(model, src, bos_id=BOS, eos_id=True, max_new_tokens=5)
    assert (
        len(decode(model, src, bos_id=np.int64(BOS), eos_id=np.int64(EOS), max_new_tokens=3)) == 3
    )


def test_decoding_refuses_logits_that_are_not_finite():
    """A model with NaN weights must not decode to a row of token 0."""
    model = EncoderDecoderTransformer(
        Seq2SeqConfig(
            src_vocab=12, tgt_vocab=12, d_model=16, n_heads=2, n_layers=1, d_mlp=16, dropout=0.0
        )
    )
    with torch.no_grad():
        model.b_U.fill_(float("nan"))
    src = torch.tensor([[3, 4, 5]])
    for decode in (greedy_decode, beam_search):
        with pytest.raises(FloatingPointError, match="logits .*are not finite"):
            decode(model, src, bos_id=1, eos_id=2, max_new_tokens=5)


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_decoding_runs_in_eval_mode_and_gives_the_mode_back(decode):
    """Dropout is off while decoding, and a model in training mode is in training mode after."""
    torch.manual_seed(5)
    model = EncoderDecoderTransformer(small_config(dropout=0.5))
    src, _ = batch_with_padding()
    expected = decode(model.eval(), src, bos_id=BOS, eos_id=EOS, max_new_tokens=6)
    model.train()
    assert decode(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=6) == expected
    assert model.training
    with pytest.raises(ValueError, match=r"max_new_tokens: expected an int >= 1 and <= 32, got 33"):
        decode(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=33)
    assert model.training


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_max_len_still_works_as_the_former_name_of_max_new_tokens(decode):
    src = torch.tensor([[5, 6]])
    with pytest.warns(DeprecationWarning, match="max_len is deprecated: call it max_new_tokens"):
        old = decode(Scripted(eos_at=99), src, bos_id=BOS, eos_id=EOS, max_len=4)
    assert old == decode(Scripted(eos_at=99), src, bos_id=BOS, eos_id=EOS, max_new_tokens=4)
