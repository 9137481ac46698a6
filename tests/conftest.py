import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("KVD_SHARED_DATA", ROOT.parent / "shared" / "data"))
