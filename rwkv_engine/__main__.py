"""`python -m rwkv_engine ...` is the `rwkv-engine` command."""

import sys

from rwkv_engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
