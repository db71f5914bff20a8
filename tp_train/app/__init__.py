"""The training app behind `train.py`: the LightningModule, the DataModule, config resolvers, preflight checks
(with the config-reading part of the memory estimate), the resume rule and the schedulers."""
