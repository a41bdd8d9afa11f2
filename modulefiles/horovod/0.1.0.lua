-- -*- lua -*-
-- hpc_horovod 0.1.0 (cluster profile: generic).
-- Written by `hpc-horovod module install`; run it again rather than editing this file.
-- The HOROVOD_* defaults below are this site's; a value a user exports before
-- `module load horovod` wins over them, and unloading restores what was there.

help([[
hpc_horovod 0.1.0: Horovod-style data-parallel training, native to SLURM clusters.

Loading this module puts the hpc-horovod command and the Python of
  /opt/hpc_horovod/0.1.0
on PATH.

  hpc-horovod check-build                what this installation can do
  srun python train.py                   in a job: one process per task
  hpc-horovod run -np 2 python train.py  outside SLURM, on this machine
  hpc-horovod notebooks copy             the example notebooks, into $WORK

Defaults set by this module (export another value before loading to change one):
  HOROVOD_CYCLE_TIME=1
  HOROVOD_FUSION_THRESHOLD=134217728
]])

whatis("Name: hpc_horovod")
whatis("Version: 0.1.0")
whatis("Description: Horovod-style data-parallel training for PyTorch and TensorFlow on SLURM clusters")
whatis("URL: https://github.com/hpc-horovod/hpc_horovod")

-- One Horovod at a time: other installations of this family are swapped out,
-- Horovod's own modules (Spack, EasyBuild names) refuse to load alongside.
family("horovod")
conflict("py-horovod", "Horovod")

prepend_path("PATH", "/opt/hpc_horovod/0.1.0/bin")
pushenv("HOROVOD_CYCLE_TIME", os.getenv("HOROVOD_CYCLE_TIME") or "1")
pushenv("HOROVOD_FUSION_THRESHOLD", os.getenv("HOROVOD_FUSION_THRESHOLD") or "134217728")
