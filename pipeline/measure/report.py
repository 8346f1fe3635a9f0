"""The benchmark report as one self-contained HTML page per build.

    python -m pipeline.measure.report <build>     # artifacts/<build>/report.html

The benchmark stage writes its own part (artifacts/<build>/benchmark/report.html:
speed against context, memory by component, the figures table). This entry
point adds what the benchmark stage does not read, the parity report of
verify_parity, and writes the combined page beside the stage folders (not
inside them: a stage's output folder is sealed by its manifest).

Charts are inline SVG written by hand: matplotlib is not a dependency (not
installed on the builders, and a heavy one for three charts), and an inline
SVG keeps the page one file with no script and no network.
"""

from __future__ import annotations

import html
import json
import math
import sys
from pathlib import Path

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 640, 320, 64, 180, 24, 48


def _e(x) -> str:
    return html.escape(str(x))


def _nice_max(v: float) -> float:
    if not v or not math.isfinite(v) or v <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * mag:
            return m * mag
    return 10 * mag


def _axes(x_label: str, y_label: str, y_max: float, x_ticks: list[tuple[float, str]]) -> list[str]:
    out = [f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" stroke="#333"/>',
           f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#333"/>']
    for i in range(5):
        v = y_max * i / 4
        y = H - PAD_B - (H - PAD_T - PAD_B) * i / 4
        out.append(f'<line x1="{PAD_L - 4}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{v:g}</text>')
    for x, label in x_ticks:
        out.append(f'<text x="{x:.1f}" y="{H - PAD_B + 16}" text-anchor="middle" font-size="11">{_e(label)}</text>')
    out.append(f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{H - 8}" text-anchor="middle" font-size="12">{_e(x_label)}</text>')
    out.append(f'<text x="14" y="{(PAD_T + H - PAD_B) / 2}" text-anchor="middle" font-size="12" '
               f'transform="rotate(-90 14 {(PAD_T + H - PAD_B) / 2})">{_e(y_label)}</text>')
    return out


def _legend(names: list[str]) -> list[str]:
    out = []
    for i, n in enumerate(names):
        y = PAD_T + 14 + 18 * i
        out.append(f'<rect x="{W - PAD_R + 12}" y="{y - 9}" width="12" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
        out.append(f'<text x="{W - PAD_R + 30}" y="{y}" font-size="11">{_e(n)}</text>')
    return out


def svg_lines(series: dict[str, list[tuple[float, float, float, float]]], x_label: str, y_label: str,
              title: str) -> str:
    """series: name -> [(x, median, min, max)]; lines through medians, min-max whiskers."""
    xs = sorted({p[0] for pts in series.values() for p in pts})
    if not xs:
        return "<p>(no data)</p>"
    y_max = _nice_max(max((p[3] for pts in series.values() for p in pts if p[3] is not None), default=1.0))
    span = (W - PAD_R - PAD_L - 40)

    def px(x):
        return PAD_L + 20 + (span * (xs.index(x) / (len(xs) - 1)) if len(xs) > 1 else span / 2)

    def py(y):
        return H - PAD_B - (H - PAD_T - PAD_B) * (y / y_max)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" aria-label="{_e(title)}">',
             f'<title>{_e(title)}</title>']
    parts += _axes(x_label, y_label, y_max, [(px(x), f"{x:g}") for x in xs])
    for i, (name, pts) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        pts = sorted(pts)
        path = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(m):.1f}" for j, (x, m, _, _) in enumerate(pts))
        parts.append(f'<path d="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, m, lo, hi in pts:
            parts.append(f'<line x1="{px(x):.1f}" y1="{py(lo):.1f}" x2="{px(x):.1f}" y2="{py(hi):.1f}" stroke="{c}"/>')
            for yy in (lo, hi):
                parts.append(f'<line x1="{px(x) - 4:.1f}" y1="{py(yy):.1f}" x2="{px(x) + 4:.1f}" y2="{py(yy):.1f}" stroke="{c}"/>')
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(m):.1f}" r="3" fill="{c}"><title>{_e(name)} @ {x:g}: '
                         f'median {m:.1f} [{lo:.1f}-{hi:.1f}]</title></circle>')
    parts += _legend(list(series))
    parts.append("</svg>")
    return "\n".join(parts)


def svg_stacked_bars(rows: dict[str, dict[str, float]], unit: str, title: str) -> str:
    """rows: bar name -> {component: value}; horizontal stacked bars."""
    if not rows:
        return "<p>(no data)</p>"
    comps = list(next(iter(rows.values())))
    total = max(sum(max(v, 0.0) for v in r.values()) for r in rows.values())
    x_max = _nice_max(total)
    bar_h, gap, left = 22, 12, 150
    height = PAD_T + len(rows) * (bar_h + gap) + 60 + 18 * len(comps)
    width = W
    plot_w = width - left - 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{_e(title)}">',
             f'<title>{_e(title)}</title>']
    for i, (name, comp) in enumerate(rows.items()):
        y = PAD_T + i * (bar_h + gap)
        parts.append(f'<text x="{left - 6}" y="{y + bar_h * 0.7}" text-anchor="end" font-size="11">{_e(name)}</text>')
        x = left
        for j, c in enumerate(comps):
            v = max(comp.get(c, 0.0), 0.0)
            w = plot_w * v / x_max
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{COLORS[j % len(COLORS)]}">'
                         f'<title>{_e(name)}: {_e(c)} {v:.1f} {unit}</title></rect>')
            x += w
        parts.append(f'<text x="{x + 4:.1f}" y="{y + bar_h * 0.7}" font-size="11">{sum(comp.values()):.0f} {unit}</text>')
    y0 = PAD_T + len(rows) * (bar_h + gap)
    parts.append(f'<line x1="{left}" y1="{y0}" x2="{left + plot_w}" y2="{y0}" stroke="#333"/>')
    for k in range(5):
        x = left + plot_w * k / 4
        parts.append(f'<text x="{x:.1f}" y="{y0 + 14}" text-anchor="middle" font-size="11">{x_max * k / 4:g}</text>')
    for j, c in enumerate(comps):
        y = y0 + 36 + 18 * j
        parts.append(f'<rect x="{left}" y="{y - 9}" width="12" height="10" fill="{COLORS[j % len(COLORS)]}"/>')
        parts.append(f'<text x="{left + 18}" y="{y}" font-size="11">{_e(c)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def svg_bars(values: list[tuple[str, float, float]], y_label: str, title: str) -> str:
    """Vertical bars (label, value, worst) with the worst value as a tick: parity SNR per prompt."""
    if not values:
        return "<p>(no data)</p>"
    finite = [v for _, a, b in values for v in (a, b) if v is not None and math.isfinite(v)]
    y_max = _nice_max(max(finite, default=1.0))
    n = len(values)
    span = W - PAD_R - PAD_L
    bw = span / n * 0.6

    def py(y):
        y = min(max(y, 0.0), y_max) if math.isfinite(y) else y_max
        return H - PAD_B - (H - PAD_T - PAD_B) * (y / y_max)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" aria-label="{_e(title)}">',
             f'<title>{_e(title)}</title>']
    parts += _axes("prompt", y_label, y_max, [(PAD_L + span * (i + 0.5) / n, str(i + 1)) for i in range(n)])
    for i, (label, mean, worst) in enumerate(values):
        x = PAD_L + span * (i + 0.5) / n
        parts.append(f'<rect x="{x - bw / 2:.1f}" y="{py(mean):.1f}" width="{bw:.1f}" height="{H - PAD_B - py(mean):.1f}" '
                     f'fill="{COLORS[0]}"><title>{_e(label)}: mean {mean:.1f} dB</title></rect>')
        if worst is not None:
            parts.append(f'<line x1="{x - bw / 2:.1f}" y1="{py(worst):.1f}" x2="{x + bw / 2:.1f}" y2="{py(worst):.1f}" '
                         f'stroke="{COLORS[1]}" stroke-width="3"><title>{_e(label)}: worst step {worst:.1f} dB</title></line>')
    parts += _legend(["logits SNR over the prompt's decode", "worst single step"])
    parts.append("</svg>")
    return "\n".join(parts)


def _fmt(s: dict, digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}&ndash;{s['max']:.{digits}f}]"


def _figures_table(report: dict) -> str:
    cols = [("decode_tok_s", "decode tok/s", 1), ("prefill_tok_s", "prefill tok/s", 1), ("ttft_ms", "TTFT ms", 1),
            ("cold_start_s", "cold start s", 2), ("warm_start_s", "warm start s", 2),
            ("peak_rss_mib", "peak RSS MiB", 0), ("resident_mib", "resident MiB", 0), ("kv_mib", "KV MiB", 2)]
    head = "".join(f"<th>{_e(c[1])}</th>" for c in cols)
    rows = []
    for arm, f in report["arms"].items():
        tag = " (artifact)" if arm == report.get("artifact_arm") else ""
        cells = "".join(f"<td>{_fmt(f[k], d) if k in f else '&ndash;'}</td>" for k, _, d in cols)
        rows.append(f"<tr><th>{_e(arm)}{tag}</th>{cells}</tr>")
    return f'<table><tr><th>arm</th>{head}</tr>{"".join(rows)}</table>'


def _verdicts(report: dict) -> str:
    items = []
    for key, label in (("artifact_vs_eager", "vs fp32 eager PyTorch"), ("artifact_vs_llamacpp", "vs llama.cpp Q4_K_M"),
                       ("artifact_vs_ortgenai", "vs onnxruntime-genai int4")):
        v = report.get(key)
        if not v:
            continue
        for fig, c in v.items():
            items.append(f"<li>{_e(fig)} {_e(label)}: {c['ratio']:.2f}x, <b>{_e(c['verdict'])}</b> "
                         f"(noise floor {c['noise_floor']:.0%})</li>")
    return "<ul>" + "".join(items) + "</ul>" if items else ""


def benchmark_sections(report: dict) -> str:
    s = report.get("settings", {})
    cross = not report.get("on_target", True)
    host = report.get("host", {})
    out = []
    if cross:
        out.append(f'<p class="cross">CROSS-MEASURED: built for {_e(report.get("device"))}, measured on a '
                   f'{_e(host.get("device_class"))} host ({_e(host.get("cpu_model"))}). These are not '
                   f'{_e(report.get("device"))} figures.</p>')
    out.append(f"<p>Host: {_e(host.get('cpu_model', '?'))}, ISA {_e(' '.join(host.get('isa', [])))}, "
               f"{_e(host.get('physical_cores', '?'))} cores; {_e(s.get('threads'))} threads used. "
               f"Prompt {_e(s.get('prompt_length'))} tokens, decode {_e(s.get('decode_tokens'))}, "
               f"context {_e(s.get('context_length'))}; {_e(s.get('passes'))} passes, {_e(s.get('order'))}. "
               "Every figure is median [min&ndash;max]; a difference under the noise floor is no difference.</p>")
    out.append("<h2>Figures</h2>" + _figures_table(report) + _verdicts(report))
    for n in report.get("notes", []):
        out.append(f'<p class="note">{_e(n)}</p>')
    series = {}
    for arm, pts in (report.get("context") or {}).items():
        series[arm] = [(float(p), v["decode_tok_s"]["median"], v["decode_tok_s"]["min"], v["decode_tok_s"]["max"])
                       for p, v in pts.items()]
    if any(series.values()):
        title = "decode tokens/s against prompt length" + (" (cross-measured)" if cross else "")
        out.append(f"<h2>{_e(title)}</h2>")
        out.append(svg_lines(series, "prompt tokens before decode (context at decode start)", "decode tok/s", title))
        out.append(f"<p>{_e(s.get('context_decode_tokens', '?'))} tokens decoded after each prefill; "
                   "whiskers are min&ndash;max over passes.</p>")
    mem = report.get("memory") or {}
    if mem:
        rows = {arm: {"interpreter + runtime libraries (before load)": m["before_load_mib"]["median"],
                      "load: weights + session": max(m["load_delta_mib"]["median"], 0.0),
                      "run: KV + activations + arenas": max(m["run_delta_mib"]["median"], 0.0)}
                for arm, m in mem.items()}
        out.append("<h2>Resident memory by component (MiB, after the headline run)</h2>")
        out.append(svg_stacked_bars(rows, "MiB", "resident memory by component"))
        trs = "".join(
            f"<tr><th>{_e(a)}</th><td>{m['weights_file_mib']['median']:.1f}</td>"
            f"<td>{m['weights_mapped_resident_mib']['median']:.1f}</td><td>{m['anon_after_run_mib']['median']:.1f}</td>"
            f"<td>{m['file_after_run_mib']['median']:.1f}</td><td>{report['arms'][a]['kv_mib']['median']:.2f}</td></tr>"
            for a, m in mem.items())
        out.append("<table><tr><th>arm</th><th>weight files on disk</th><th>weight files mapped and resident</th>"
                   "<th>anonymous resident</th><th>file-backed resident</th><th>KV held</th></tr>" + trs + "</table>")
        out.append("<p>Resident is counted from /proc/self/smaps (pages in memory), never allocated size.</p>")
    return "\n".join(out)


def parity_section(parity: dict) -> str:
    art = parity.get("artifact") or {}
    per = art.get("per_prompt") or parity.get("per_prompt") or []
    vals = [(p.get("prompt", f"#{i}"), p.get("logits_snr_db"), p.get("worst_step_snr_db")) for i, p in enumerate(per)]
    vals = [v for v in vals if v[1] is not None]
    out = ["<h2>Parity: logits SNR per prompt</h2>"]
    out.append(svg_bars(vals, "SNR dB", "parity SNR per prompt"))
    out.append("<p>verify_parity records per prompt the SNR over its decode and the worst single step, "
               "not the SNR of every step; the bar is the former, the red tick the latter.</p>")
    items = "".join(f"<li>{i + 1}: {_e(v[0])}</li>" for i, v in enumerate(vals))
    out.append(f"<ol style='font-size:11px'>{items}</ol>")
    steps = step_snr_series(per)
    if steps:
        out.append("<h2>Parity: logits SNR per decode step</h2>")
        out.append(svg_lines({"SNR over prompts": steps}, "decode step (bins of 8)", "SNR dB",
                             "parity SNR per decode step"))
        out.append("<p>Each point: median over the prompts and the 8 steps of its bin; whiskers: min-max. "
                   "A drop past the sliding window would show where the window starts to slide.</p>")
    return "\n".join(out)


KLD_FLOOR = 1e-6  # the plot's log scale starts here (a KLD this small is no difference at all)


def kld_section(parity: dict) -> str:
    """Perplexity and llama.cpp's KL statistics per arm (the artifact and its peers): a table and the KLD
    distribution of each arm (its percentiles, log scale)."""
    art = parity.get("artifact") or {}
    arms = {art.get("path", "artifact"): art.get("kld")}
    arms.update({name: p.get("kld") for name, p in (art.get("peers") or {}).items()})
    arms = {k: v for k, v in arms.items() if v}
    if not arms:
        return ""
    ev = parity.get("evaluation") or {}
    out = ["<h2>Perplexity and KL divergence against fp32 (llama.cpp's statistics)</h2>",
           f"<p class='note'>{_e(ev.get('windows'))} windows of {_e(ev.get('n_ctx'))} tokens of "
           f"{_e(ev.get('text'))}, {_e(ev.get('scored_tokens'))} tokens scored ({_e(ev.get('scored'))}).</p>",
           "<table><tr><th>arm</th><th>PPL</th><th>PPL(fp32)</th><th>ln ratio</th><th>mean KLD</th>"
           "<th>median</th><th>p99</th><th>p99.9</th><th>max</th><th>same top-1 %</th><th>RMS dp %</th></tr>"]
    for name, k in arms.items():
        out.append(f"<tr><td>{_e(name)}</td><td>{k['ppl']:.3f}</td><td>{k['ppl_base']:.3f}</td>"
                   f"<td>{k['ln_ppl_ratio']:.4f} ± {k['ln_ppl_ratio_err']:.4f}</td>"
                   f"<td>{k['kld_mean']:.4f} ± {k['kld_mean_err']:.4f}</td><td>{k['kld_median']:.4f}</td>"
                   f"<td>{k['kld_p99']:.3f}</td><td>{k['kld_p99_9']:.3f}</td><td>{k['kld_max']:.3f}</td>"
                   f"<td>{k['same_top1_pct']:.2f}</td><td>{k['rms_dp_pct']:.2f}</td></tr>")
    out.append("</table>")
    series = {}
    for name, k in arms.items():
        dist = k.get("kld_distribution") or {}
        pts = [(float(q), math.log10(max(float(v), KLD_FLOOR) / KLD_FLOOR)) for q, v in dist.items()]
        series[name] = [(x, y, y, y) for x, y in pts]
    out.append(svg_lines(series, "percentile of tokens", f"log10(KLD / {KLD_FLOOR:g} nats)",
                         "KLD distribution per arm"))
    out.append("<p class='note'>Each arm's per-token KL divergence from the fp32 model at the percentiles "
               "on the axis (100: the worst token), log scale from 1e-6 nats.</p>")
    return "\n".join(out)


def step_snr_series(per_prompt: list[dict], bin_steps: int = 8) -> list[tuple[float, float, float, float]]:
    """(first step of bin, median, min, max) of the per-step SNR over prompts, finite values only."""
    import statistics

    bins: dict[int, list[float]] = {}
    for p in per_prompt:
        for i, v in enumerate(p.get("step_snr_db") or []):
            if isinstance(v, (int, float)):
                bins.setdefault(i // bin_steps * bin_steps, []).append(float(v))
    return [(float(b), statistics.median(v), min(v), max(v)) for b, v in sorted(bins.items())]


STYLE = """body{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}
th{background:#f4f4f4}.cross{background:#fff3cd;border:1px solid #e0b000;padding:8px;font-weight:bold}
.note{color:#555;font-size:12px}"""


def render(report: dict, parity: dict | None = None, build: str = "") -> str:
    label = "" if report.get("on_target", True) else " (cross-measured)"
    body = [f"<h1>edgekiln benchmark: {_e(build)}{label}</h1>", benchmark_sections(report)]
    if parity:
        body.append(parity_section(parity))
        body.append(kld_section(parity))
    else:
        body.append("<p class='note'>Parity not shown here: the benchmark stage does not read verify_parity; "
                    f"<code>python -m pipeline.measure.report {_e(build)}</code> writes the page with it.</p>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(build)} benchmark</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def main(argv=None) -> int:
    from pipeline.engine.layout import ROOT, output_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m pipeline.measure.report <build>   (writes artifacts/<build>/report.html)", file=sys.stderr)
        return 2
    build = argv[0]
    bench = ROOT / output_dir("benchmark", build) / "report.json"
    if not bench.is_file():
        print(f"error: {bench.relative_to(ROOT)} not found: build it first (python -m pipeline ...)", file=sys.stderr)
        return 1
    par = ROOT / output_dir("verify_parity", build) / "report.json"
    parity = json.loads(par.read_text()) if par.is_file() else None
    out = bench.parent.parent / "report.html"
    out.write_text(render(json.loads(bench.read_text()), parity, build))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
