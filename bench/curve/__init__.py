"""The learning curve: τ of each head against its training tokens, beside prompt lookup, at equal budgets.

Config: conf/experiment/curve.yaml (conf/experiment/curve2m.yaml: the 2M-token curve of four recipes). Every head
listed there is trained once, with the same recipe on the same precompute folder (the same batches in the same
order), to the last token point, into `<out>/<head>`; the step hook exports the head where the training tokens
(packed rows) reach each log-spaced point and keeps a resumable checkpoint every `checkpoint_every` steps, so a
re-run resumes and skips measured points. Each point is measured
by greedy speculative decoding through the engine on held-out prompts (τ at k with its standard error,
per-position acceptance; untimed), and prompt lookup once on the same prompts, the floor a head must clear.
Data: the config's `data.paths` when given, else the shared self-distilled set when ../shared/data has it
(data=shared-regen), else the demo's conversations.
Outputs in `--out` (default runs/curve): curve.json (every point), curve.md and curve.png.

Run it as `python -m bench.curve` (`make curve`). The modules, in the order a run uses them:

    config.py    conf/experiment/curve.yaml typed, the heads it names, the recipe variants' definitions
    data.py      the precompute folder(s), made here or given, checked to hold what each head reads
    plan.py      the log-spaced token points, the steps that reach them, the step hook that exports there
    measure.py   a point: τ of a head (or prompt lookup) on the held-out prompts
    variants.py  the variants' loop and resume rule
    kgrid.py     the head's own best k: τ at each k of a grid at the last point (a block drafter up to its block)
    seeds.py     one recipe over several seeds; two heads compared across them
    report.py    fits, tables (heads, variants, seeds) and the plot
    record.py    docs/curve.json, the committed record a fresh checkout resumes from
    run.py       the entry: the whole run, driven by the command line
"""
