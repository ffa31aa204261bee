"""What several subcommands share: argument helpers (checkpoint, sampling, thinking budget), reading --messages,
printing outputs and logprobs. The commands import it and not one another (tests/test_layering.py: no cycles)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .. import DEFAULT_CHECKPOINT  # noqa: F401  (re-exported for the commands)
from ..errors import UserError
from ..generation.sampling import MAX_LOGPROBS, PENALTY_RANGE

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float64": "float64"}
# The TT precision presets (tt/model/model_config.py PrecisionSetting.named) and the one a TT run uses unless told.
TT_PRECISIONS = ("accuracy", "performance", "performance-bf4")
DEFAULT_TT_PRECISION = "performance"


def precision_name(text: str) -> str:
    """A precision name ``PrecisionSetting.named`` accepts (a preset and ``+`` modifiers), else a usage error."""
    from ..tt.model.model_config import PrecisionSetting

    try:
        PrecisionSetting.named(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--ids is empty")
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--ids must be non-negative, got {text!r}")
    return ids


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_checkpoint_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", "-c", type=Path, default=None,
                   help="HF checkpoint directory (default: $HF_MODEL, else the embedded default checkpoint)")


def resolve_checkpoint(arg: Path | None) -> Path:
    if arg is not None:
        path, source = arg, "--checkpoint"
    elif os.environ.get("HF_MODEL"):
        path, source = Path(os.environ["HF_MODEL"]), "$HF_MODEL"
    else:
        path, source = DEFAULT_CHECKPOINT, "embedded default"
    if not path.is_dir():
        raise UserError(f"checkpoint directory {path} ({source}) does not exist")
    return path


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """vLLM's sampling parameters, names and meanings; the same on plain and speculative decoding (speculative
    sampling with them is exact: it emits the target's own distribution)."""
    g = p.add_argument_group("sampling (vLLM's names and meanings; plain and speculative decoding alike)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (argmax of the penalised logits); > 0 = sample (speculative: rejection sampling)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 or -1 = off)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="keep the smallest set of most likely tokens whose mass reaches p, in (0, 1] (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min_p x the most likely one, in [0, 1] (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: tokens seen in the prompt or output get positive logits divided by it and negative "
                        "ones multiplied by it (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help=f"in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]: subtracted from the logit of every token "
                        "already in the output (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help=f"in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]: subtracted once per occurrence in the output "
                        "(0 = off)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help=f"print each emitted token's logprob and rank plus the N most likely tokens, N in "
                        f"[0, {MAX_LOGPROBS}] (raw logprobs: the model's log-softmax before penalties, temperature "
                        "and truncation, vLLM's default)")
    g.add_argument("--seed", type=int, default=0, help="seed of every random draw of the run (same seed, same output)")


def sampling_params(args: argparse.Namespace):
    """The one SamplingParams of a run, validated (a bad value is a one-line UserError naming it)."""
    from ..generation.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, draft=args.draft, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, logprobs=args.logprobs)


def add_thinking_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--thinking-budget", type=int, default=None, metavar="N",
                   help="at N thinking tokens without </think>, inject Qwen's stop-thinking phrase and continue "
                        "(0 = non-thinking mode; default unlimited)")


def read_messages(path: Path) -> list[dict]:
    from ..chat import validate_messages

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"--messages: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--messages {path}: not JSON ({e.msg}, line {e.lineno})") from None
    return validate_messages(data)


def print_logprobs(logprobs, tok) -> None:
    """One line per emitted token: index, id, logprob, rank, then the top-n as id:logprob (and the token text)."""
    if logprobs is None:
        return
    print("logprobs (raw; per emitted token: i id logprob rank | top-n id:logprob):")
    for i, lp in enumerate(logprobs):
        top = " ".join(f"{t}:{v:.4f}" for t, v in lp.top)
        text = f"  {tok.decode([lp.token])!r}" if tok is not None else ""
        print(f"  {i} {lp.token} {lp.logprob:.4f} {lp.rank} | {top}{text}".rstrip())


def print_outputs(outputs: list[list[int]], texts: list[str] | None, tok) -> None:
    """One user: ``ids:`` (+ ``prompt:`` / ``text:``); several: the same lines with ``[i]`` per user i."""
    for i, out in enumerate(outputs):
        tag = "" if len(outputs) == 1 else f"[{i}]"
        print(f"ids{tag}:", ",".join(map(str, out)))
        if tok is not None:
            print(f"prompt{tag}:", texts[i])
            print(f"text{tag}:", tok.decode(out))
