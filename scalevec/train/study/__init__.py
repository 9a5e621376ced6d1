"""The study behind `scalevec-ablate`: a grid of model sizes x scale-vector variants x learning rates x seeds
(`grid`), its finished runs read back (`records`), each variant at its best learning rate with paired differences
(`summary`), scaling fits (`scaling`), the paper's claims with their verdicts (`claims`), and the files that report
them (`report`)."""
