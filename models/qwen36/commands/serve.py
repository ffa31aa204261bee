"""qwen36 serve: the OpenAI-compatible API, served by the real ``vllm serve`` (vLLM 0.25.1) through the vllm-tt plugin
with this project's model class (docs/serving.md), on two P150a cards or on the emulated mesh.

The command builds the ``vllm serve`` arguments a Qwen3.6 launch needs (one prompt per prefill, no prefix caching,
no async scheduling, block size 64, traces on; Qwen3.6's reasoning and tool-call parsers on), registers the model
class through the repository's bundle directory (``vllm_models/``), and runs vLLM's own CLI in this process. On
``--device emulated-p150x2`` the plugin's worker opens this project's emulated 1x2 mesh instead of cards: its
``open_mesh_device`` is replaced before vLLM starts, and vLLM's engine core is started with ``fork`` so that it
inherits the replacement. SIGINT / SIGTERM stop the server (vLLM shuts its engine core down) and the command returns.

    qwen36 serve --device emulated-p150x2                    # the embedded checkpoint on http://127.0.0.1:8000/v1
    qwen36 serve --device p150x2 -c /path/to/Qwen3.6-27B --max-model-len 32768 --spec-k 3
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from ..errors import UserError
from .common import DEFAULT_TT_PRECISION, TT_PRECISIONS, add_checkpoint_arg, positive_int, resolve_checkpoint

DEVICES = ("emulated-p150x2", "p150x2")
# Qwen3.6's parsers in vLLM 0.25.1. Tool calls: Qwen3.5 / Qwen3.6 write <tool_call><function=NAME><parameter=ARG>
# blocks (XML, the chat template's layout), which `qwen3_coder` parses (`qwen3_xml` is the same class in 0.25.1);
# `hermes` expects a JSON object inside <tool_call> and would hand such a call back as raw text.
REASONING_PARSER = "qwen3"
TOOL_CALL_PARSER = "qwen3_coder"
KV_BLOCK = 64  # vLLM's --block-size: the model's KV page (allocate_kv_cache_per_layer refuses another)
MAX_SEQS = 32  # a plain launch decodes 1..32 sequences (docs/serving.md)
MAX_K = 7  # --spec-k auto: the deepest step the depth policy covers (the verify width vLLM reserves)
CARD_TT = {"trace_region_size": 67108864, "fabric_config": "FABRIC_1D"}  # 64 MiB of traces; CCLs between the cards
MODEL_DRAFTER = "vllm_tt_plugin.model_owned_drafter"  # the plugin's marker: the model drafts (its MTP head)
REPO = Path(__file__).resolve().parents[3]


def _spec_k(text: str) -> str:
    if text == "auto" or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"--spec-k must be a positive integer or 'auto', got {text!r}")


def _seqs(text: str) -> int:
    n = positive_int(text)
    if n > MAX_SEQS:
        raise argparse.ArgumentTypeError(f"--max-num-seqs must be in 1..{MAX_SEQS}, got {n}")
    return n


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="the OpenAI API: vllm serve + the vllm-tt plugin (cards or the emulated mesh)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--device", required=True, choices=DEVICES,
                   help="p150x2: two P150a cards; emulated-p150x2: the emulated mesh (no cards, slow)")
    add_checkpoint_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive_int, default=8000)
    p.add_argument("--served-model-name", default="qwen36", help="the model id clients ask for")
    p.add_argument("--max-num-seqs", type=_seqs, default=1, help=f"sequences decoded together, 1..{MAX_SEQS}")
    p.add_argument("--max-model-len", type=positive_int, default=4096,
                   help="tokens per request, prompt included (the KV pool holds max-model-len x max-num-seqs)")
    p.add_argument("--precision", default=DEFAULT_TT_PRECISION, choices=TT_PRECISIONS,
                   help="the TT precision preset (docs/tt_precision.md)")
    p.add_argument("--spec-k", type=_spec_k, default=None, metavar="K|auto",
                   help="MTP speculative decoding with K drafts (auto: the depth per step), max-num-seqs 1, greedy "
                        "requests; needs a vllm-tt plugin with a speculative runner")
    p.add_argument("--reasoning-parser", default=REASONING_PARSER,
                   help=f"vLLM reasoning parser, or 'none' (default {REASONING_PARSER}: <think> ... </think>)")
    p.add_argument("--tool-call-parser", default=TOOL_CALL_PARSER,
                   help=f"vLLM tool-call parser, or 'none' (default {TOOL_CALL_PARSER}: Qwen3.6's <tool_call> "
                        "XML blocks); with a parser, tool_choice auto is on")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="after --: more `vllm serve` arguments, passed as they are")
    p.set_defaults(run=run)


def vllm_argv(args: argparse.Namespace, checkpoint: Path) -> list[str]:
    """The ``vllm serve`` arguments of this launch (docs/serving.md says why each is there)."""
    tt = {"trace_mode": "all", "optimizations": args.precision}
    if args.device == "p150x2":
        tt.update(CARD_TT)
    argv = [str(checkpoint), "--served-model-name", args.served_model_name,
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_model_len), "--block-size", str(KV_BLOCK),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--no-async-scheduling"]
    if args.spec_k is not None:
        k = MAX_K if args.spec_k == "auto" else int(args.spec_k)
        if args.spec_k == "auto":
            tt["spec_depth"] = "auto"
        argv += ["--speculative-config", json.dumps({"method": "custom_class", "model": MODEL_DRAFTER,
                                                     "num_speculative_tokens": k})]
    argv += ["--additional-config", json.dumps({"tt": tt})]
    if args.reasoning_parser != "none":
        argv += ["--reasoning-parser", args.reasoning_parser]
    if args.tool_call_parser != "none":
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
    extra = list(args.vllm_args or [])
    return argv + ["--host", args.host, "--port", str(args.port)] + (extra[1:] if extra[:1] == ["--"] else extra)


def check_launch(args: argparse.Namespace) -> Path:
    """Everything a launch needs that can be checked before vLLM starts; a one-line UserError otherwise."""
    checkpoint = resolve_checkpoint(args.checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise UserError(f"{checkpoint}: no config.json (pass a local HF checkpoint directory)")
    for module, what in (("vllm", "vLLM 0.25.1"), ("vllm_tt_plugin", "the vllm-tt plugin")):
        if importlib.util.find_spec(module) is None:
            raise UserError(f"qwen36 serve needs {what} installed next to this project "
                            "(scripts/install_vllm_tt.sh; docs/serving.md)")
    if not (REPO / "vllm_models").is_dir():
        raise UserError(f"{REPO / 'vllm_models'} is missing: qwen36 serve registers the model class from the "
                        "repository's bundle directory (install this project editable from a checkout)")
    if args.device == "p150x2":
        from ..tt_ops.device import TT_DEVICE_DIR, count_tenstorrent_cards, simulator_path

        cards = count_tenstorrent_cards()
        if simulator_path() is None and cards < 2:
            raise UserError(f"--device p150x2 needs two P150a cards and {cards} are present ({TT_DEVICE_DIR}); to "
                            "try the API without cards pass --device emulated-p150x2")
    if args.spec_k is not None:
        if importlib.util.find_spec("vllm_tt_plugin.spec_decode") is None:
            raise UserError("--spec-k: the installed vllm-tt plugin has no speculative runner "
                            "(vllm_tt_plugin.spec_decode; plugin e3fc849 has none), so a speculative launch cannot "
                            "start (docs/serving_contract.md)")
        if args.max_num_seqs != 1:
            raise UserError(f"--spec-k serves one sequence: pass --max-num-seqs 1, not {args.max_num_seqs}")
    if args.reasoning_parser != "none" or args.tool_call_parser != "none":
        from ..tokenizer import load_chat_tokenizer  # the parsers read <think> / <tool_call> markers

        load_chat_tokenizer(checkpoint)
    return checkpoint


def emulated_mesh_for_the_plugin() -> None:
    """Make the plugin's worker open the emulated 1x2 mesh (once per engine core) instead of cards."""
    from vllm_tt_plugin import worker as plugin_worker

    from ..tt.runtime.generator import DEFAULT_TRACE_REGION
    from ..tt_ops.device import open_mesh

    opened: list = []

    def open_emulated(*_a, **_k):  # runs in the engine core, which vLLM forks from this process
        if not opened:
            opened.append(open_mesh("emulated-p150x2", trace_region_size=DEFAULT_TRACE_REGION))
        return opened[0].mesh_device

    def close_emulated(*_a, **_k):
        while opened:
            opened.pop().close()

    plugin_worker.open_mesh_device = open_emulated
    plugin_worker.close_mesh_device = close_emulated


def launch(args: argparse.Namespace, checkpoint: Path, prepare=None) -> int:
    """Run ``vllm serve`` in this process until it is stopped. ``prepare()`` runs first, in this process (whatever it
    patches, vLLM's forked engine core inherits): the HTTP soak installs its recorders there."""
    os.environ.update(MESH_DEVICE="P150x2", EXTRA_MODELS_DIR=str(REPO / "vllm_models"))
    # vLLM 0.25.1 waits this long for the engine core's READY (after weight conversion, KV allocation, warmup and
    # trace capture; default 600 s, a first 27B start may need more: docs/serving.md)
    os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", "3600")
    if args.device == "emulated-p150x2":
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the engine core inherits the emulated mesh
        emulated_mesh_for_the_plugin()
    if prepare is not None:
        prepare()
    argv = vllm_argv(args, checkpoint)
    print(f"qwen36 serve: {args.device}{' (emulated mesh, no hardware)' if args.device.startswith('emulated') else ''}"
          f", {checkpoint}, http://{args.host}:{args.port}/v1\n  vllm serve {' '.join(argv)}", file=sys.stderr,
          flush=True)
    sys.argv = ["vllm", "serve", *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


def run(args: argparse.Namespace) -> int:
    return launch(args, check_launch(args))
