"""The DREAM drafter (design section 4): `model.py` the network, `compression.py` which image positions it
keeps, `checkpoint.py` its files, `stage.py` the `dream` stage. Its training and ablations live outside the
runtime, in the repository's `training/` package (`python -m training.train`)."""
