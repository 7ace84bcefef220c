"""The calibration ``forward_loop`` over a Megatron ``GPTDataset`` (post_training.modelopt.calibration_loop).

A small on-disk corpus (``IndexedDatasetBuilder``) is built into the training split of a ``GPTDataset``;
quantizing with the loop over its first batches gives exactly the quantizer amaxes of quantizing with a
hand-written loop over the same samples, shows progress, and bad sizes are refused before quantizing.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.datasets.gpt_dataset import GPTDatasetConfig
from megatron_core.datasets.tokenizers import NullTokenizer
from megatron_core.post_training.modelopt.calibration_loop import (
    build_calibration_dataset,
    calibration_batches,
    get_forward_loop,
)
from tests.datasets.conftest import write_corpus
from tests.post_training.quant_test_utils import SEQ, build

CORPUS_VOCAB = 100  # tokens 0..99 and EOD 100, inside the model's vocabulary of 128


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("calib") / "corpus")
    write_corpus(prefix, 60, seed=5)
    config = GPTDatasetConfig(random_seed=3, sequence_length=SEQ, blend=([prefix], None), split="100,0,0",
                              tokenizer=NullTokenizer(CORPUS_VOCAB), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False)
    return build_calibration_dataset(config, 8)


def _amaxes(model) -> dict[str, torch.Tensor]:
    return {name: buf.clone() for name, buf in model.state_dict().items() if name.endswith("_amax")}


def test_loop_runs_the_dataset_batches_like_a_hand_written_loop(dataset, capsys):
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.calibration import check_calibrated

    calls = []
    ours = build()
    ours.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    mtq.quantize(ours, mtq.FP8_DEFAULT_CFG, get_forward_loop(dataset, 3, batch_size=2))
    check_calibrated(ours)
    assert calls == [torch.Size([2, SEQ])] * 3

    def by_hand(model):
        for start in (0, 2, 4):
            samples = [dataset[i] for i in (start, start + 1)]
            model(torch.stack([s["tokens"] for s in samples]), torch.stack([s["position_ids"] for s in samples]),
                  None)

    theirs = build()
    mtq.quantize(theirs, mtq.FP8_DEFAULT_CFG, by_hand)
    ours_amax, theirs_amax = _amaxes(ours), _amaxes(theirs)
    assert ours_amax.keys() == theirs_amax.keys() and any("input_quantizer" in k for k in ours_amax)
    for name, value in ours_amax.items():
        torch.testing.assert_close(value, theirs_amax[name], rtol=0, atol=0, msg=name)
    assert "calibrating: 3/3 batch" in capsys.readouterr().err  # the progress lines (stderr is not a terminal)


def test_batches_stack_samples_from_the_offset(dataset):
    batches = list(calibration_batches(dataset, 2, batch_size=3, sample_offset=1))
    assert [tuple(b["tokens"].shape) for b in batches] == [(3, SEQ), (3, SEQ)]
    torch.testing.assert_close(batches[1]["tokens"][2], dataset[6]["tokens"])


@pytest.mark.parametrize("kwargs, message", [
    ({"num_batches": 0}, r"num_batches \(0\) must be positive"),
    ({"num_batches": 2, "batch_size": 0}, r"batch_size \(0\) must be positive"),
    ({"num_batches": 1, "sample_offset": -1}, r"sample_offset \(-1\) must not be negative"),
])
def test_bad_sizes_are_refused(dataset, kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_forward_loop(dataset, **kwargs)


def test_a_dataset_too_short_is_refused(dataset):
    n = len(dataset)
    with pytest.raises(ValueError, match=rf"holds {n} samples; {n} batches of 2 from sample 1 need {2 * n + 1}"):
        get_forward_loop(dataset, n, batch_size=2, sample_offset=1)


def test_zero_samples_are_refused(tmp_path):
    config = GPTDatasetConfig(random_seed=3, sequence_length=SEQ, tokenizer=NullTokenizer(CORPUS_VOCAB),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    with pytest.raises(ValueError, match=r"num_samples \(0\) must be positive"):
        build_calibration_dataset(config, 0)
