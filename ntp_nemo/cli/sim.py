"""`ntp-sim`: the cluster goodput simulator's Hydra entry point.

With no arguments it simulates the paper setting (480B model, 32K B200 GPUs in NVL32 domains,
TP32 x PP8), prints the tables and writes results.json, results.csv and PNG plots into the
Hydra run directory. Any key of `conf/sim` can be overridden; `-m` sweeps write a summary table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ntp_nemo.config.paths import conf_dir
from ntp_nemo.errors import EXIT_CONFIG, ConfigError, cli_main, report_config_error
from ntp_nemo.goodput.sim.output import format_tables, write_plots, write_records
from ntp_nemo.goodput.sim.preflight import preflight
from ntp_nemo.goodput.sim.settings import SimSettings, settings_from_config
from ntp_nemo.goodput.sim.studies import SimResults, run_all

CONFIG_DIR = conf_dir() / "sim"


def simulate(settings: SimSettings, out_dir: Path, echo: bool = True) -> SimResults:
    """Run the studies and write every output into `out_dir`."""
    if settings.plots:
        from ntp_nemo.errors import require_extra

        require_extra("matplotlib", "plots", "plots", "ntp-sim's PNG plots", "set plots=false for tables, "
                      "results.json and results.csv alone")
    start = time.perf_counter()
    results = run_all(settings)
    elapsed = time.perf_counter() - start
    json_path, _ = write_records(results.records, out_dir)
    plots = write_plots(results, settings, out_dir) if settings.plots else []
    if echo:
        print(format_tables(results, settings))
        print(
            f"\nsimulated in {elapsed:.1f} s; results: {json_path} (+ results.csv"
            + (", " + ", ".join(p.name for p in plots) if plots else "")
            + ")",
            flush=True,
        )
    return results


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def _hydra_entry(cfg: DictConfig) -> None:
    try:
        settings = settings_from_config(cfg)
    except ConfigError as err:  # Hydra would turn it into exit code 1 with a traceback
        report_config_error(err)
        sys.exit(EXIT_CONFIG)
    simulate(settings, Path(HydraConfig.get().runtime.output_dir))


def _main() -> None:
    preflight(CONFIG_DIR, "config", sys.argv[1:], settings_from_config)
    _hydra_entry()


main = cli_main(_main)

if __name__ == "__main__":
    main()
