"""The engine-step probe of bench_sim_calibration.py (its sitecustomize.py); a package only so that mypy
names it apart from gateway_phases/sitecustomize.py."""
