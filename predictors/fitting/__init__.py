"""Fitting a cluster profile (neox_perf.predictors.fitting): everything that makes one, none
of what reads it.

samples         the published sample files read into training sets (train)
cleaning        samples that cannot measure the stated work dropped, phases derived
fit             per op/phase: a physical baseline and trees on its residual (scikit-learn, XGBoost)
export          the fitted trees as flat arrays (the profile's arrays.npz)
train           the bundled profiles from the published samples
calibrated      a profile of this machine from its calibration store (`neox-perf calibrate`)
step_fit        the step terms fitted on measured end-to-end runs
devset          the development set of measured runs (vTrain) read as NeoX configs

Loading and predicting never import this package: scikit-learn, XGBoost and scipy are only
needed here.
"""
