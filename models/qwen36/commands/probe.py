"""qwen36 probe NAME --device DEV [probe options] [--records FILE]: run a registered probe, append its run record."""
from __future__ import annotations

import argparse


def add_parser(sub, name: str) -> None:
    from qwen36.probes.registry import probe_names  # import-light: names only

    p = sub.add_parser(name, help="run a registered probe (probes/registry.py) and append one run record",
                       description="Probes: " + ", ".join(probe_names()) + ". Use `qwen36 probe NAME --help` for its options.")
    p.add_argument("probe", choices=probe_names(), metavar="NAME", help="probe name: " + ", ".join(probe_names()))
    p.add_argument("probe_args", nargs=argparse.REMAINDER, help="options of the probe")
    p.set_defaults(run=run)




def run(args: argparse.Namespace) -> int:
    from loguru import logger

    from qwen36.probes.records import append_record, to_record
    from qwen36.probes.registry import load_probe, probe_parser

    module = load_probe(args.probe)
    pargs = probe_parser(args.probe, module).parse_args(args.probe_args)
    report = module.run(pargs)
    record = to_record(report)
    path = append_record(record, pargs.records, records_dir_arg=pargs.records_dir)
    failed = [c for c in report.cells if not c.get("pass")]
    logger.info(f"[{report.backend}] probe {args.probe}: {len(report.cells)} cells, {len(failed)} failed, "
                f"verdict {record['verdict']}, gate_complete {record['gate_complete']}")
    for c in failed[:20]:
        print(f"FAIL {c.get('cell')}: {', '.join(c.get('failed', []))}")
    if report.notes:
        print("notes:", ", ".join(f"{k}={v}" for k, v in report.notes.items()))
    print(f"verdict: {record['verdict']}  record: {path}")
    return 0 if record["verdict"] == "pass" else 1
