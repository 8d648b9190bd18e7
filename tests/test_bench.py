import torch

from kernelmix.studies.bench import interleaved_medians_ms


def test_interleaved_medians_time_the_ops_round_robin():
    calls = []
    fns = [lambda name=name: calls.append(name) for name in "abc"]
    medians = interleaved_medians_ms(fns, repeats=3, device=torch.device("cpu"))
    # one warm-up call each, then every repetition runs every op once, in order
    assert calls == list("abc") * 4
    assert len(medians) == 3 and all(ms >= 0 for ms in medians)


def test_interleaved_medians_are_medians_per_op():
    import time

    def slow():
        time.sleep(0.02)

    medians = interleaved_medians_ms([slow, lambda: None], repeats=3, device=torch.device("cpu"))
    assert medians[0] >= 20 > medians[1]
