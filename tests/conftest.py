"""Suite-wide setup: npuq's cache (GGUF metadata, thread tuning) goes to a fresh temporary folder."""

import os
import tempfile

os.environ["NPUQ_CACHE_DIR"] = tempfile.mkdtemp(prefix="npuq-test-cache-")
