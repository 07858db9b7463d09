"""``plugdist debug analyze DIR``: read every rank's flight-recorder dump, say where ranks diverge.

For each group, in this order:

* **mismatch** — the first collective whose fingerprint differs between ranks (op, reduce op,
  root, shapes, dtypes, devices, all-to-all sizes);
* **behind** — ranks that issued fewer collectives than the others: which rank, its last
  collective, and the collective (number and op) the others are waiting at;
* **never completed** — the first collective (or point-to-point op) that is still ``scheduled``
  (waiting for the cross-rank check) or ``started`` (handed to the backend) somewhere;
* **failed** — the first collective that failed, with its error.

Ranks are global ranks. A rank without a dump file is reported too (dead, or dumped elsewhere).
Pure reading: never touches a running job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fingerprint import Fingerprint, differences, rank_list
from .flight_recorder import FAILED, SCHEDULED, STARTED

__all__ = ["Finding", "AnalyzeError", "load_dumps", "analyze", "render", "run"]


class AnalyzeError(ValueError):
    """The directory holds no readable dump."""


@dataclass(frozen=True)
class Finding:
    """One divergence: ``kind`` is missing_dump, mismatch, behind, incomplete or failed."""

    kind: str
    group: str | None
    seq: int | None
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "group": self.group, "seq": self.seq, "text": self.text}


def load_dumps(directory: str | Path) -> dict[int, dict[str, Any]]:
    """Every ``rank_*.json`` in ``directory``, by global rank. Raises AnalyzeError if none."""
    folder = Path(directory)
    if not folder.is_dir():
        raise AnalyzeError(f"{folder} is not a directory (set PLUGDIST_FLIGHT_RECORDER_DIR to "
                           f"where the ranks dumped)")
    dumps: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob("rank_*.json")):
        try:
            doc = json.loads(path.read_text())
            dumps[int(doc["rank"])] = doc
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise AnalyzeError(f"{path} is not a flight-recorder dump: {err}") from err
    if not dumps:
        raise AnalyzeError(f"no flight-recorder dumps (rank_*.json) in {folder}")
    return dumps


def _op_of(entries: dict[int, dict[int, dict[str, Any]]], seq: int) -> str:
    for by_seq in entries.values():
        if seq in by_seq:
            return str(by_seq[seq]["op"])
    return "?"


def _group_findings(name: str, docs: dict[int, dict[str, Any]]) -> list[Finding]:
    """Findings for one group; ``docs`` maps global rank to that rank's dump of the group."""
    out: list[Finding] = []
    label = f"group {name!r}"
    entries = {r: {e["seq"]: e for e in d["entries"] if e.get("seq") is not None}
               for r, d in docs.items()}

    # 1. the first collective whose fingerprints disagree (later ones are usually its echo)
    seqs = sorted({s for by_seq in entries.values() for s in by_seq})
    mismatched: list[tuple[int, list[str]]] = []
    for seq in seqs:
        have = [r for r in sorted(entries) if seq in entries[r]
                and entries[r][seq].get("fingerprint") is not None]
        if len(have) < 2:
            continue
        fps = [Fingerprint.from_json(entries[r][seq]["fingerprint"]) for r in have]
        diffs = differences(fps, ranks=have)
        if diffs:
            mismatched.append((seq, diffs))
    if mismatched:
        seq, diffs = mismatched[0]
        more = (f" ({len(mismatched) - 1} later collective(s) mismatch too: "
                + ", ".join(f"#{s}" for s, _ in mismatched[1:6])
                + (", ..." if len(mismatched) > 6 else "") + ")") if len(mismatched) > 1 else ""
        out.append(Finding("mismatch", name, seq, f"{label}: ranks diverge at collective #{seq}: "
                           + "; ".join(diffs) + more))
    explained = {s for s, _ in mismatched}

    # 2. ranks that issued fewer collectives than the rest
    issued = {r: int(d.get("collectives_issued", 0)) for r, d in docs.items()}
    top = max(issued.values())
    ahead = [r for r, n in issued.items() if n == top]
    for count in sorted({n for n in issued.values() if n < top}):
        # collectives are numbered from 1: a rank that issued `count` last issued #count
        behind = [r for r, n in issued.items() if n == count]
        last = (f"its last was {_op_of({r: entries[r] for r in behind}, count)} #{count}"
                if count else "it issued none")
        waited = count + 1
        explained.add(waited)
        there = [entries[r][waited] for r in ahead if waited in entries[r]]
        states = sorted({e["state"] if e["state"] != FAILED or not e.get("error")
                         else f"failed with {e['error'].split(':', 1)[0]}" for e in there})
        state = f" ({'/'.join(states)} there)" if states else ""
        out.append(Finding(
            "behind", name, waited,
            f"{label}: {rank_list(behind)} {'is' if len(behind) == 1 else 'are'} behind: "
            f"issued {count} collective(s), {last}; {rank_list(ahead)} issued {top}, and wait at "
            f"{_op_of(entries, waited)} #{waited}{state}, which "
            f"{rank_list(behind)} never reached"))

    # 3. the first op that never completed (beyond what is explained above)
    for seq in seqs:
        if seq in explained:
            continue
        pending: dict[str, list[int]] = {}
        for r in sorted(entries):
            e = entries[r].get(seq)
            if e is not None and e["state"] in (SCHEDULED, STARTED):
                pending.setdefault(e["state"], []).append(r)
        if pending:
            parts = []
            if STARTED in pending:
                parts.append(f"started on {rank_list(pending[STARTED])} (handed to the backend, "
                             f"which never finished it)")
            if SCHEDULED in pending:
                parts.append(f"scheduled on {rank_list(pending[SCHEDULED])} (waiting for the "
                             f"cross-rank check)")
            out.append(Finding("incomplete", name, seq, f"{label}: {_op_of(entries, seq)} "
                               f"#{seq} never completed: " + "; ".join(parts)))
            break
    for r, d in sorted(docs.items()):
        for e in d["entries"]:
            if e.get("seq") is None and e["state"] in (SCHEDULED, STARTED):
                out.append(Finding("incomplete", name, None,
                                   f"{label}: rank {r}'s {e['op']} (point-to-point #{e['p2p_seq']}"
                                   f", peer group rank {e['peer']}) never completed"))
                break

    # 4. the first collective that failed (beyond what is explained above)
    for seq in seqs:
        if seq in explained:
            continue
        failed = {r: entries[r][seq] for r in sorted(entries)
                  if seq in entries[r] and entries[r][seq]["state"] == FAILED}
        if failed:
            first = next(iter(failed.values()))
            reason = (first.get("error") or "").splitlines()[0] if first.get("error") else ""
            out.append(Finding("failed", name, seq, f"{label}: {first['op']} #{seq} "
                               f"failed on {rank_list(failed)}: {reason}"))
            break
    return out


def analyze(dumps: dict[int, dict[str, Any]]) -> list[Finding]:
    """Every finding across ``dumps`` (global rank -> dump), group by group."""
    out: list[Finding] = []
    world_size = max(int(d.get("world_size", 0)) for d in dumps.values())
    absent = [r for r in range(world_size) if r not in dumps]
    if absent:
        out.append(Finding("missing_dump", None, None,
                           f"no dump from {rank_list(absent)}: dead, hung before the dump, or "
                           f"dumped to another directory"))
    by_group: dict[str, dict[int, dict[str, Any]]] = {}
    members: dict[str, list[int]] = {}
    for rank, doc in dumps.items():
        for name, gdoc in doc.get("groups", {}).items():
            by_group.setdefault(name, {})[rank] = gdoc
            members.setdefault(name, list(gdoc.get("global_ranks", [])))
    for name in sorted(by_group, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n)):
        docs = by_group[name]
        silent = [r for r in members[name] if r not in docs and r not in absent]
        if silent:
            out.append(Finding("missing_dump", name, None,
                               f"group {name!r}: {rank_list(silent)} dumped no record of it"))
        out.extend(_group_findings(name, docs))
    return out


def render(directory: str | Path, dumps: dict[int, dict[str, Any]],
           findings: list[Finding]) -> str:
    """The human-readable report."""
    lines = [f"read {len(dumps)} dump(s) from {directory}: {rank_list(sorted(dumps))}"]
    reasons = {d.get("reason", "?") for d in dumps.values()}
    lines.append("dump reasons: " + "; ".join(sorted(reasons)))
    for name in sorted({n for d in dumps.values() for n in d.get("groups", {})}):
        counts = {r: d["groups"][name].get("collectives_issued", 0)
                  for r, d in sorted(dumps.items()) if name in d.get("groups", {})}
        lines.append(f"group {name!r}: collectives issued per rank: "
                     + ", ".join(f"{r}: {n}" for r, n in counts.items()))
    if not findings:
        lines.append("no divergence found: every rank issued the same collectives, with "
                     "matching fingerprints, and all of them completed")
    else:
        lines.append(f"{len(findings)} finding(s):")
        lines += [f"- {f.text}" for f in findings]
    return "\n".join(lines)


def run(directory: str | Path, as_json: bool = False) -> tuple[str, int]:
    """Analyze ``directory``; returns (output, exit code): 0 nothing found, 1 divergence found,
    2 no readable dumps."""
    try:
        dumps = load_dumps(directory)
    except AnalyzeError as err:
        return (json.dumps({"error": str(err)}) if as_json else f"error: {err}"), 2
    findings = analyze(dumps)
    if as_json:
        text = json.dumps({"ranks": sorted(dumps), "findings": [f.to_json() for f in findings]},
                          indent=1)
    else:
        text = render(directory, dumps, findings)
    return text, 1 if findings else 0

