"""Packaged Hydra config tree (installed as ntp_nemo.conf)."""
