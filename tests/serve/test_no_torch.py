"""Serve's boundary: importing it, building the app and answering a completion pull in no torch,
no transformers and nothing from train/ or export/ (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, time
import doel.serve.edge.app, doel.serve.cli, doel.serve.core.engine, doel.serve.core.sampling
import doel.serve.core.textstream
from fastapi.testclient import TestClient
from doel.serve.edge.app import Settings, create_app

with TestClient(create_app(Settings(bundle=sys.argv[1], threads=1))) as c:
    while c.get("/health").status_code != 200:
        time.sleep(0.02)
    r = c.post("/v1/completions", json={"prompt": "নদী", "max_tokens": 3})
    assert r.status_code == 200, r.text
banned = ("torch", "transformers", "train", "export", "onnxruntime_genai", "optimum")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in banned)))
"""


def test_serving_imports_no_torch_nor_other_stages(tiny_bundle):
    bundle = tiny_bundle
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(bundle)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
