from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch

from runner.ops import apply_to_tensors, convert_to_fp32, send_to_device

Pair = namedtuple("Pair", "a b")


@dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    label: str


class Listed(list):
    pass


class Tagged(dict):
    def __init__(self, tag, *args, **kwargs):  # a constructor that does not take a plain dict
        super().__init__(*args, **kwargs)
        self.tag = tag


def test_apply_to_tensors_keeps_container_types_and_leaves_others():
    tagged = Tagged("t", w=torch.ones(1))
    data = {
        "pair": Pair(torch.ones(2), [torch.zeros(1), 3]),
        "ordered": OrderedDict(k=torch.ones(1)),
        "batch": Batch(torch.ones(3), "keep"),
        "tagged": tagged,
        "text": "unchanged",
        "weights": (torch.nn.Parameter(torch.ones(1)), {"bias": torch.nn.Parameter(torch.ones(1))}),
        "listed": Listed([torch.ones(1)]),
    }
    out = apply_to_tensors(lambda t: t + 1, data)
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].a, torch.full((2,), 2.0))
    assert out["pair"].b[1] == 3 and torch.equal(out["pair"].b[0], torch.ones(1))
    assert isinstance(out["ordered"], OrderedDict)
    assert isinstance(out["batch"], Batch) and out["batch"].label == "keep"
    assert torch.equal(out["batch"].x, torch.full((3,), 2.0))
    assert isinstance(out["tagged"], Tagged) and out["tagged"].tag == "t"
    assert torch.equal(out["tagged"]["w"], torch.full((1,), 2.0)) and torch.equal(tagged["w"], torch.ones(1))
    assert out["text"] == "unchanged"
    # a tensor subclass inside the plain containers that the walker takes first, and a list subclass
    assert type(out["weights"]) is tuple and torch.equal(out["weights"][0], torch.full((1,), 2.0))
    assert torch.equal(out["weights"][1]["bias"], torch.full((1,), 2.0))
    assert type(out["listed"]) is Listed and torch.equal(out["listed"][0], torch.full((1,), 2.0))


def test_send_to_device_and_convert_to_fp32():
    data = [
        torch.ones(2, dtype=torch.bfloat16),
        {"ids": torch.arange(3), "x": torch.ones(1, dtype=torch.float64)},
    ]
    placed = send_to_device(data, torch.device("cpu"))
    assert placed[0] is data[0]  # already there: no copy
    converted = convert_to_fp32(data)
    assert converted[0].dtype == torch.float32 and converted[1]["ids"].dtype == torch.int64
    assert converted[1]["x"].dtype == torch.float64  # only half precision is upcast, as Accelerate's
