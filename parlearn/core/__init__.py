"""What every lesson and technique stands on; imports nothing else of parlearn.

- ``device``: pick the device, describe the machine, fake JAX CPU devices, thread counts;
- ``timing``: honest timing: warm-up, repeats, medians, CUDA sync, interleaved compare;
- ``settings``: FAST mode and size presets;
- ``checks``: the argument checks shared by every public function;
- ``viz``: figures with measured/modeled labelling built in;
- ``widgets``: the Dashboard (compute + plot + sliders) every explorer uses;
- ``datasets``: scikit-learn's bundled digits, fixed split;
- ``models``: small seeded models (the MLP the data-parallel lessons train);
- ``recipe``: the training recipe (AdamW decay groups, global-norm clip, warm-up + cosine)
  that every parallel wrapper runs unchanged;
- ``bench``: the :class:`~parlearn.core.bench.Row` every technique's ``bench`` returns;
- ``basics``: work and depth, Amdahl, batched vs looped (lesson ``00_start_here``);
- ``overhead``: the one model of batched work, ``t(n) = t0 + c n`` fitted to measured
  times, that Parts 3 and 4 read every batched-vs-looped measurement with.
"""
