"""``import unison.keras`` loads no framework beyond what ``import keras`` loaded for the active backend
(docs/keras_backends.md: "imports only what the active backend needs"). One process per backend, no MPI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import ROOT

FRAMEWORKS = ("tensorflow", "torch", "jax", "jaxlib", "tf_keras", "flax")

PROBE = f"""
import json, sys
def loaded():
    return sorted({{name.split(".")[0] for name in sys.modules}} & set({FRAMEWORKS!r}))
import keras
before = loaded()
import unison.keras
print(json.dumps({{"backend": keras.backend.backend(), "keras": before, "unison": loaded()}}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow"])
def test_importing_unison_keras_loads_no_framework_keras_did_not(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["backend"] == backend
    assert backend in seen["keras"], seen  # (the probe sees the backend's own framework)
    extra = sorted(set(seen["unison"]) - set(seen["keras"]))
    assert seen["unison"] == seen["keras"], f"import unison.keras also loaded {extra} on {backend}"
