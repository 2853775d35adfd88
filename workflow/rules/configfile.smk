# Read before the Snakefile's `configfile:` directive, which would stop at a YAML error with
# Snakemake's own message (no file, line or column): ddpflow names them, and a key given
# twice. (A file given with --configfile is read by Snakemake's command line, before this.)
import sys
from pathlib import Path

from ddpflow.config import ConfigError
from ddpflow.config.yamlfile import read_config_file

if Path("config/config.yaml").is_file():
    try:
        read_config_file("config/config.yaml")
    except ConfigError as err:
        sys.exit(f"ddpflow: configuration error: {err}")
