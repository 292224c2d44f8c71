"""``python -m geomx.netem``: run the WAN emulator configured by GEOMX_* environment variables."""
import logging
import sys

from geomx.errors import ConfigError
from geomx.netem.emulator import run_from_env


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run_from_env()
    except ConfigError as exc:
        print(f"geomx.netem: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
