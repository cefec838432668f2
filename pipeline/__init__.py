"""The rented-GPU recipe and the demo: the only part of train/ that reaches into the export and
serve stages. spec (the recipe file, the plan), order (the stages and their chain), runner
(skip-if-complete, preflight), stages (what each does), fetch (data), budget (disk, memory,
time and cost), summary, demo."""
