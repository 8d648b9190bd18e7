"""What produces kernelmix's results: each study is a function that runs, measures and writes
JSON + Markdown + PNG into a folder (the committed ones live under ``results/``).

- :mod:`.compare` — train every mixer on the same data and budget, validation loss by length.
- :mod:`.recall` — multi-query associative recall per mixer, width and difficulty.
- :mod:`.finetune` — finetune converted pretrained models: softmax vs Performer vs DARKFormer.
- :mod:`.diagnose` — kernel diagnostics of a converted pretrained model.
- :mod:`.darkformer_report` — the DARKFormer report on a real model (diagnostics + finetuning).
- :mod:`.bench` — op speed and memory per mixer against length, with peers.
- :mod:`.generate_bench` — generation throughput per mixer, cached vs uncached.
- :mod:`.demo` — every mixer on one random batch: time and error against its reference.
"""
