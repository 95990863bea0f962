"""``python -m runner``: the Hydra app over ``conf/config.yaml``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from runner.schema import register_configs  # noqa: E402

log = logging.getLogger("runner")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    """Compose the run config, then execute it into the Hydra run dir. Exits non-zero when items failed."""
    from runner.evidence import EvidenceError
    from runner.execute import USER_ERRORS, run

    hc = HydraConfig.get()
    try:
        code = run(cfg, Path(hc.runtime.output_dir), overrides=list(hc.overrides.task))
    except EvidenceError as e:  # everything was written; the evidence contradicts the resolution
        log.error("%s: %s", type(e).__name__, e)
        sys.exit(3)
    except USER_ERRORS as e:  # bad input or a refused backend: a clear message, no traceback
        log.error("%s: %s", type(e).__name__, e)
        sys.exit(2)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
