"""The study behind `scalevec-ablate`: a grid of model sizes x scale-vector variants x learning rates x seeds
(`grid`), every run's record (finished, diverged or missing) read back from its folder or from `results.json`
(`records`), each variant at the learning rate it wins on the selection half of the held-out blocks with paired
differences on the report half (`summary`), intervals and verdicts (`intervals`), Huber scaling fits with
seed-bootstrap intervals (`scaling`), the paper's claims with their verdicts (`claims`), and the files that report
them (`report`). Nothing here imports the Trainer: a finished study is read from records alone."""
