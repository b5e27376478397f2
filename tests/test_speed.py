"""What `--precision auto` and `--channels-last auto` choose on each kind of machine (config/speed.py)."""

import pytest
import torch

from ray_job.config.speed import Speed, gpu_has_bf16


@pytest.mark.parametrize("bf16_card, expected", [(True, Speed(True, True, True)),
                                                 (False, Speed(True, False, True))])
def test_auto_precision_is_bf16_only_on_a_gpu_that_has_it(bf16_card, expected):
    # A card without bf16 (before compute capability 8.0) trains in fp32: the step has no loss
    # scaling, which fp16 would need.
    assert Speed.choose("auto", "auto", use_gpu=True, cuda_available=True, bf16_card=bf16_card) == expected


@pytest.mark.parametrize("bf16_card", [True, False])
def test_cpu_workers_train_in_fp32_nchw_whatever_the_node_has(bf16_card):
    assert Speed.choose("auto", "auto", use_gpu=False, cuda_available=True, bf16_card=bf16_card) == Speed(
        False, False, False)


def test_an_explicit_precision_and_layout_are_kept():
    assert Speed.choose("bf16", "on", use_gpu=False, cuda_available=False, bf16_card=False) == Speed(False, True, True)
    assert Speed.choose("fp32", "off", use_gpu=True, cuda_available=True, bf16_card=True) == Speed(True, False, False)


def test_without_a_given_answer_the_gpu_of_this_process_is_asked():
    speed = Speed.choose("auto", "auto", use_gpu=True, cuda_available=torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert speed == Speed(False, False, False)
        return
    major, _ = torch.cuda.get_device_capability()
    assert gpu_has_bf16() == (major >= 8)
    assert speed == Speed(True, major >= 8, True)
