"""Stage 05's on-disk format, eval/: report.json (its keys, check, save, load) and report.md's tables. The folder's
layout is ``records.DataDir``.
"""

from __future__ import annotations

import json

from .anchors import wall_clock_settings
from .records import FORMAT_VERSION, DataDir, FormatError, atomic_write_bytes, atomic_write_json

# Stage 05: evaluation report
#
#   eval/report.json   {format_version, config_hash, config, num_speculative_tokens (the exported draft's k),
#                      num_speculative_tokens_by_draft: {draft: k} (each draft at its own k: an EAGLE-3 draft at
#                      evaluate.num_speculative_tokens, a DFlash draft at its block size - 1), num_prompts,
#                      concurrency: [..],
#                      benchmarks: [{name, source, size, prompt_ids}], drafts: [{name, folder, server: {command,
#                      env, log, start_s} | {url}}], verifier_alone: {server} | null,
#                      acceptance: {draft: {set: {acceptance_length, per_position_acceptance, drafts, draft_tokens,
#                      accepted_tokens, accepted_per_position, ...}}}   (pooled over the concurrency levels)
#                      tokens_per_s: {draft | "verifier alone": {set: {level: x}}}, speedup: {draft: {set: {level}}},
#                      runs: {column: {set: {by_concurrency: {level: {requests, completion_tokens, wall_s,
#                      tokens_per_s, per_request: [{id, completion_tokens, speculative_decoding (vLLM's counters)}],
#                      server_counters, ...acceptance figures of that pass}}}}},
#                      with_draft / without_draft: the exported draft / the verifier alone over every set,
#                      platform: {platform, device, device_count, tensor_parallel_size, vllm_version, ...},
#                      drafts[].provenance: {steps, trained_steps, rows_per_step, samples, train_samples, config_hash,
#                      export} | null,
#                      anchors: [{draft, target, settings, source, acceptance_length: {set: x}, note}],
#                      decode_timings: {column: {set: {level: {step_ms, tpot_ms}}}} (vLLM's inter-token latency:
#                      one engine step; its per-request time per output token; null where the server has neither),
#                      step_costs: {draft: {set: {level: {step_cost (speculation step / plain step), acceptance_length,
#                      speedup_allowed (acceptance length / step cost)}}}} | null (no verifier alone),
#                      wall_clock_anchors: [{draft, target, engine, hardware, concurrency, speedup, detail, source,
#                      input_tokens, output_tokens}] (anchors.WALL_CLOCK)}
#   eval/report.md     one table per measure: rows = sets, columns = drafts
#   eval/acceptance.png  acceptance length grouped by set (written by evaluate.py)

EVAL_REQUIRED_KEYS = ("num_speculative_tokens", "benchmarks", "drafts", "acceptance", "tokens_per_s", "speedup",
                      "runs", "with_draft")


def eval_markdown_table(report: dict) -> str:
    """The report as markdown: acceptance length, per-position acceptance, then tokens/s and speedup per
    concurrency level; rows = benchmark sets, columns = drafts (tokens/s also the verifier alone)."""
    sets = [b["name"] for b in report["benchmarks"]]
    drafts = [d["name"] for d in report["drafts"]]
    levels = [str(c) for c in report["concurrency"]]
    alone = "verifier alone"

    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)

    def table(title: str, cols: list[str], cell) -> list[str]:
        lines = [f"### {title}", "", "| benchmark | " + " | ".join(cols) + " |", "| --- |" + " ---: |" * len(cols)]
        lines += ["| " + s + " | " + " | ".join(cell(c, s) for c in cols) + " |" for s in sets]
        return lines + [""]

    ks = draft_ks(report)
    if len(set(ks.values())) > 1:  # drafts at their own k (EAGLE-3 beside DFlash): the column says which
        def label(c: str) -> str:
            return f"{c} (k={ks[c]})" if c in ks else c

        report = {**report, **{key: {label(c): v for c, v in report[key].items()}
                               for key in ("acceptance", "tokens_per_s", "speedup", "decode_timings", "step_costs")
                               if report.get(key)}}
        drafts = [label(c) for c in drafts]
        k_text = "each draft at its own k (draft tokens per step, in its column)"
    else:
        k_text = f"k = {report['num_speculative_tokens']} draft tokens per step"
    acc = report["acceptance"]
    sources = sorted({p.get("acceptance_source", "") for col in ks for per_set in report["runs"][col].values()
                      for p in per_set["by_concurrency"].values()})
    lines = [
        f"Verifier `{report.get('verifier', '')}`, {k_text}, "
        f"{report.get('num_prompts', '?')} prompts per set, concurrency {', '.join(levels)}, temperature "
        f"{report.get('temperature', '?')}, thinking {report.get('thinking', '?')}. Drafts: "
        + ", ".join(f"`{d['name']}` = {d['folder'] or d['server'].get('url')}" for d in report["drafts"]) + ".",
        f"Acceptance pools every concurrency level; counted from {'; '.join(sources)}.",
        "",
    ]
    plat = report.get("platform")
    if plat:
        version = plat.get("vllm_version")
        lines += [f"Platform: vLLM {', '.join(version) if isinstance(version, list) else version} on "
                  f"{plat.get('device') or plat.get('platform', '?')} ({plat.get('platform', '?')}"
                  + (f", {plat['device_count']} device(s)" if plat.get("device_count") else "") + "), tensor "
                  f"parallel {plat.get('tensor_parallel_size', '?')} on servers started here "
                  f"({plat.get('servers_started_here', '?')} started here, {plat.get('servers_given', 0)} given by "
                  "URL).", ""]
    for d in report["drafts"]:
        prov = d.get("provenance")
        if prov:
            trained = f" ({prov['train_samples']} trained)" if prov.get("train_samples") is not None else ""
            lines += [f"Draft `{d['name']}`: trained {prov['trained_steps']} steps, exported step {prov['steps']} "
                      f"({prov['export']}), {prov['rows_per_step']} packed rows a step, {prov['samples']} "
                      f"samples{trained}, training config hash `{prov['config_hash']}` ({prov['provenance']}).", ""]
    lines += table("Acceptance length (1 + accepted / drafts)", drafts,
                   lambda c, s: fmt(acc[c][s]["acceptance_length"], ".3f"))
    anchors = report.get("anchors") or []
    if anchors:
        lines += [f"### Published acceptance length of public drafts beside ours (their harness, prompts and "
                  "settings: the same measure, not the same experiment)", "",
                  "| benchmark | " + " | ".join(f"ours: {c}" for c in drafts) + " | "
                  + " | ".join(a["draft"] for a in anchors) + " |", "| --- |" + " ---: |" * (len(drafts) + len(anchors))]
        for s in sets:
            lines.append("| " + s + " | " + " | ".join(fmt(acc[c][s]["acceptance_length"], ".3f") for c in drafts)
                         + " | " + " | ".join(fmt(a["acceptance_length"].get(s), ".2f") for a in anchors) + " |")
        lines += [""] + [f"- {a['draft']}: target {a['target']}; {a['settings']}"
                         + (f"; from {a['source']}" if a.get("source") else "")
                         + (f"; {a['note']}" if a.get("note") else "") for a in anchors] + [""]
    lines += table("Per-position acceptance (accepted at position i / drafts; i = 0, 1, ...)", drafts,
                   lambda c, s: " / ".join(f"{r:.2f}" for r in acc[c][s]["per_position_acceptance"]) or "n/a")
    tps, speedup = report["tokens_per_s"], report["speedup"]
    timings, costs = report.get("decode_timings") or {}, report.get("step_costs") or {}
    cols = ([alone] if alone in tps else []) + drafts
    for level in levels:
        lines += table(f"Tokens/s at concurrency {level}", cols, lambda c, s: fmt(tps[c][s][level], ".1f"))
        if alone in tps:
            lines += table(f"Speedup over the verifier alone at concurrency {level}", drafts,
                           lambda c, s: fmt(speedup[c][s][level], ".3f"))
        if timings:
            lines += table(f"Decode step, ms (vLLM's inter-token latency: one engine step; with a draft, k drafts and "
                           f"their verification) / time per output token, ms, at concurrency {level}", cols,
                           lambda c, s: " / ".join(fmt(timings[c][s][level][key], ".2f")
                                                   for key in ("step_ms", "tpot_ms")))
        if costs:
            lines += table(f"Speculation step in plain steps / speedup its acceptance allows at that cost "
                           f"(acceptance length / step cost) at concurrency {level}", drafts,
                           lambda c, s: " / ".join(fmt(costs[c][s][level][key], ".3f")
                                                   for key in ("step_cost", "speedup_allowed")))
    anchors = report.get("wall_clock_anchors") or []
    if anchors and alone in tps:
        ours = "; ".join(f"{c} {' / '.join(fmt(speedup[c][s][level], '.2f') for level in levels)} on {s}"
                         for c in drafts for s in sets)
        lines += ["### Published wall-clock speedups of Kimi drafts beside ours (other engines, GPUs, models and "
                  "loads: the same measure, not the same experiment)", "",
                  f"Ours (concurrency {' / '.join(levels)}): {ours}.", "",
                  "| draft | target | concurrency | speedup | settings |", "| --- | --- | ---: | ---: | --- |"]
        lines += [f"| {a['draft']} | {a['target']} | {a['concurrency']} | {a['speedup']:.2f} | "
                  f"{wall_clock_settings(a)} |" for a in anchors] + [""]
    return "\n".join(lines)


def draft_ks(report: dict) -> dict[str, int]:
    """Each draft column's k: ``num_speculative_tokens_by_draft``, or the one k of reports written before it."""
    by_draft = report.get("num_speculative_tokens_by_draft") or {}
    return {d["name"]: int(by_draft.get(d["name"], report["num_speculative_tokens"])) for d in report["drafts"]}


def check_eval_report(report: dict, where: str = "eval report") -> None:
    for key in EVAL_REQUIRED_KEYS:
        if key not in report:
            raise FormatError(f"{where}: lacks key {key!r}")
    ks = draft_ks(report)
    for draft, per_set in report["acceptance"].items():
        k = ks.get(draft, report["num_speculative_tokens"])
        for name, figures in per_set.items():
            if len(figures.get("per_position_acceptance", [])) not in (0, k):
                raise FormatError(f"{where}: {draft} / {name}: {len(figures['per_position_acceptance'])} per-position "
                                  f"figures for k = {k}")


def save_eval_report(data_dir: DataDir, report: dict, config_hash: str, config: dict) -> None:
    """Write eval/report.json and eval/report.md atomically."""
    full = {"format_version": FORMAT_VERSION, "config_hash": config_hash, **report, "config": config}
    check_eval_report(full, str(data_dir.eval_report))
    atomic_write_json(data_dir.eval_report, full)
    atomic_write_bytes(data_dir.eval_markdown, eval_markdown_table(full).encode())


def load_eval_report(data_dir: DataDir) -> dict:
    path = data_dir.eval_report
    if not path.is_file():
        raise FileNotFoundError(f"no evaluation report at {path}: run 05_evaluate.py")
    report = json.loads(path.read_text())
    check_eval_report(report, str(path))
    return report
