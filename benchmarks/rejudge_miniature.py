"""The CPU miniature's weight-decay rows (RESULTS.md, issue 36) judged by the study's rules since issue 42: Student t
intervals on the paired Δ per seed and Holm over the rows. The Δ are the ones that table publishes (its run folders
were not kept); the runs used one learning rate, so no selection half was needed or possible."""

from scalevec.train.study.intervals import holm, paired_interval, verdict

rows = {  # Δ per seed (0, 1, 2), 4x128 at lr 3e-3: RESULTS.md "Weight decay by role at 4.1 M tokens a run"
    ("standard-input-exempt − standard", "higher"): [-0.0185, -0.0092, +0.0166],
    ("unified-input-exempt − unified", "higher"): [-0.0193, -0.0229, +0.0014],
    ("unified-output-norm-decayed − unified-output-norm", "higher"): [+0.0009, -0.0208, +0.0219],
    ("unified − standard", "lower"): [-0.0243, -0.0571, -0.0707],
}
intervals = {key: paired_interval(d) for key, d in rows.items()}
adjusted = dict(zip(rows, holm([i.p_value for i in intervals.values()])))
for (name, expected), i in intervals.items():
    corrected = verdict(i, expected, adjusted[name, expected] < 0.05)
    print(
        f"| {name} | Δ {'> 0' if expected == 'higher' else '< 0'} | {i.mean:+.4f} | {i.low:+.4f} to {i.high:+.4f} "
        f"| {i.p_value:.3f} | {adjusted[name, expected]:.3f} | {verdict(i, expected)} | {corrected} |"
    )
