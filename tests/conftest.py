"""Shared pytest setup: local-only Ray settings and the repository root on sys.path."""
import os
import sys
from pathlib import Path

# Ray on one machine: bind to 127.0.0.1 and no token auth (../shared/ENVIRONMENT.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
