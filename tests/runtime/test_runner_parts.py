"""A chain of parts run in turn and called as one program (a generation step): which parts stay
loaded is decided from the memory each part's first call took; the others are read again at
every call. The reference for the outputs is the same chain with every part kept; the policy
is checked against the memory a fake allocator reports."""

import torch

import npuq.runtime.runner as runner
from npuq.resources import USABLE_FRACTION
from npuq.runtime.runner import PartChain, Residency


class _Part:
    """Part (first, end) of a model whose layers each add a number; reading it takes ``size``
    bytes of the fake memory, released by ``release()``."""

    def __init__(self, memory, first, end, size):
        self.memory, self.layers, self.size = memory, (first, end), size
        self.loaded, self.reads = False, 0

    def __call__(self, x, mask, positions, *caches):
        if not self.loaded:
            self.loaded, self.reads = True, self.reads + 1
            self.memory[0] -= self.size
        n = self.layers[1] - self.layers[0]
        k_news = [c + 1 for c in caches[:n]]
        return (x + sum(range(*self.layers)), *k_news, *caches[n:])

    def release(self):
        if self.loaded:
            self.loaded = False
            self.memory[0] += self.size


def _chain(memory, sizes, in_turn=True, residency=None):
    layers = [(i, i + 1) for i in range(len(sizes))]
    return PartChain(layers, [_Part(memory, *l, s) for l, s in zip(layers, sizes)], in_turn=in_turn,
                     residency=residency)


def _call(chain):
    L = chain.num_layers
    x, mask, pos = torch.zeros(1, 2), torch.zeros(1), torch.zeros(1)
    return chain(x, mask, pos, *[torch.full((1,), float(i)) for i in range(2 * L)])


def test_parts_stay_loaded_while_twice_the_largest_fits_and_the_rest_are_read_at_each_call(monkeypatch):
    memory = [0]
    monkeypatch.setattr(runner, "available_memory", lambda: memory[0])
    sizes = [100, 100, 100, 100]
    # room for the first two parts and then twice the largest: parts 0 and 1 stay, 2 and 3 cycle
    memory[0] = int((2 * 100 + 2 * 100) / USABLE_FRACTION) + 1
    chain = _chain(memory, sizes)
    reference = _call(_chain([1 << 40], sizes, in_turn=False))
    for step in range(3):
        out = _call(chain)
        assert all(torch.equal(a, b) for a, b in zip(out, reference))
    assert chain.resident == {0: True, 1: True, 2: False, 3: False}
    assert [p.reads for p in chain.programs] == [1, 1, 3, 3]
    assert [p.loaded for p in chain.programs] == [True, True, False, False]  # what cycles is released


def test_without_room_every_part_is_released_after_each_call(monkeypatch):
    memory = [150]
    monkeypatch.setattr(runner, "available_memory", lambda: memory[0])
    chain = _chain(memory, [100, 100, 100])
    for _ in range(2):
        _call(chain)
    assert chain.resident == {0: False, 1: False, 2: False}
    assert [p.reads for p in chain.programs] == [2, 2, 2] and memory == [150]


def test_the_chains_of_one_model_share_the_largest_footprint(monkeypatch):
    """A decode chain whose parts the prefill chain measured does not start over: a part that
    costs little to read (its weights already held) stays only while twice the largest part
    measured by either chain still fits."""
    memory = [0]
    monkeypatch.setattr(runner, "available_memory", lambda: memory[0])
    residency = Residency()
    memory[0] = int(3 * 100 / USABLE_FRACTION) + 1  # room for one part and then twice the largest
    prefill = _chain(memory, [100, 100], residency=residency)
    _call(prefill)
    assert prefill.resident == {0: True, 1: False} and residency.largest == 100
    decode = _chain(memory, [30, 30], residency=residency)  # cheap beside the prefill chain's
    _call(decode)
    assert decode.resident == {0: False, 1: False}
    alone = _chain(memory, [30, 30])  # measured on its own, it would have kept both
    _call(alone)
    assert alone.resident == {0: True, 1: True}
