"""What ``geomx bench wan`` trains (``--workload``): the digits classifier for quick runs, the byte-level
language model for runs long enough that what crosses the WAN decides the result."""
from __future__ import annotations

from dataclasses import dataclass

from geomx.errors import ConfigError


@dataclass(frozen=True)
class Workload:
    name: str
    script: str                    # under examples/
    model_flag: str                # the script's flag that picks the model
    models: tuple[str, ...]
    default_model: str
    description: str
    # the script's learning-rate schedule spans its --steps, so rows of other lengths also learn at other rates
    schedule_spans_steps: bool = False
    target_flag: str = "--target-acc"    # what its evaluations measure: the flag that sets a target of it


WORKLOADS = {w.name: w for w in (
    Workload("digits", "train_cnn.py", "--model", ("wide", "cnn", "deep", "vgg"), "wide",
             "examples/train_cnn.py on scikit-learn's 8x8 digits (test accuracy)"),
    Workload("lm", "train_lm.py", "--model-size", ("tiny", "small", "base"), "tiny",
             "examples/train_lm.py, a byte-level GPT on the Python standard library's source (validation loss)",
             schedule_spans_steps=True, target_flag="--target-loss"),
)}


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; workloads: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def model_for(w: Workload, model: str | None) -> str:
    """The model of ``w`` named by ``--model`` (default: the workload's), checked."""
    if model is None:
        return w.default_model
    if model not in w.models:
        raise ConfigError(f"--model {model!r} is not a model of workload {w.name!r}: {', '.join(w.models)}")
    return model


def workload_of_command(command: list[str]) -> Workload:
    """The workload a kept run trained, from its training command's script."""
    return next((w for w in WORKLOADS.values() if any(str(a).endswith(w.script) for a in command)),
                WORKLOADS["digits"])
