"""A cluster profile's typed home (no torch, no rich; numpy only where arrays are read).

values     what a profile answers: Prediction, BatchPrediction, Coverage, ProfileInfo
facts      the hardware a profile describes: ClusterFacts, Link
manifest   manifest.json parsed once into frozen sections (Manifest), written back as read
models     the manifest's operator and collective model entries
sections   its small sections: provenance, calibration, training, arrays, validation runs
disturbance  whether the calibration was disturbed, and the warning every report carries
directory  the one reader and writer of a profile directory (read, write, replacing, update)
protocol   Profile: what estimate, plan, the runs and the renderers ask of any profile

Both kinds of profile (predictors/sampled.py, predictors/transfer.py) build on these;
predictors/profile.py loads either. The engine and step-term sections live with the code that
applies them (neox_perf/prediction/corrections/).
"""
