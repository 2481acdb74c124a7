"""The DREAM drafter (design section 4): `model.py` the network, `compression.py` which image positions it
keeps, `checkpoint.py` its files, `stage.py` the `dream` stage, `training/` its training and ablations,
`train.py` their command line."""
