"""pipespec.stages.vocabulary: every stage's logits at the target's width, padding rows masked."""

from __future__ import annotations

import pytest
import torch

from pipespec.config import ConfigError
from pipespec.stages.vocabulary import LogitsFit


def test_same_table_is_left_alone():
    fit = LogitsFit.of("s", 10, 10, 10)
    x = torch.randn(2, 10)
    assert fit.identity and fit(x) is x


@pytest.mark.parametrize("own", [8, 10, 12])
def test_other_tables_are_cut_or_padded_to_the_target_width(own):
    fit = LogitsFit.of("s", own, width=10, valid=8)
    x = torch.randn(3, own)
    y = fit(x)
    assert y.shape == (3, 10)
    assert torch.equal(y[:, :8], x[:, :8])
    assert torch.isinf(y[:, 8:]).all() and (y[:, 8:] < 0).all()
    assert (y.softmax(-1)[:, 8:] == 0).all()


def test_the_target_masks_its_own_padding():
    fit = LogitsFit.of("target", 12, None, 9)
    assert fit.width == 12 and fit.valid == 9 and not fit.identity


def test_a_table_smaller_than_the_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="stage 'tiny': its LM head has 7 rows but the shared tokenizer has 8 tokens"):
        LogitsFit.of("tiny", 7, 10, 8)
