"""`python -m helexa.engine.core FD PARENT_PID`: the engine core process (started by `EngineClient`)."""

import sys

from helexa.engine.core.process import main

if __name__ == "__main__":
    sys.exit(main())
