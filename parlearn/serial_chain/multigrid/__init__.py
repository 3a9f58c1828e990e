"""Layer-parallel ResNets by nonlinear multigrid (MGRIT with FAS) (lesson 21).

A ResNet is forward Euler on an ODE: ``x_{n+1} = x_n + h F(x_n, theta_n)``, n = 0..N-1.
The serial forward pass (:class:`SerialResNet`, the baseline) is a sweep of N dependent
steps. Multigrid reduction in time (MGRIT) solves the same N+1 equations iteratively, with
most of its work batched across layers; the backward pass is the adjoint recursion, solved
by the same MGRIT code in reverse.

==================  ======================================================================
module              what it holds
==================  ======================================================================
``stack``           the residual functions (:func:`dense_tanh`, :func:`conv_tanh`) and
                    :class:`ResidualStack`: N layers' parameters stacked for batched calls
``solver``          the generic MGRIT/FAS solver on a step function: relaxations, V-cycles,
                    :func:`residual`, :func:`exact_iterations`
``layer_parallel``  forward and adjoint of a stack by MGRIT, :class:`LayerParallelResNet`
                    beside the serial baseline :class:`SerialResNet`, :func:`train_digits`
``cost``            the cost model (depth and work vs the serial sweep) and the bench rows
``speed``           lesson 21's speed dashboard: :func:`speed_sweep` (MGRIT and the serial
                    ResNet timed beside the modeled limits), :func:`plot_speed`, and the
                    readings both lessons 21 and 29 print: :func:`read_above`,
                    :func:`cal_reading`
==================  ======================================================================

The names a notebook uses are re-exported here:
``from parlearn import multigrid as mg; mg.mgrit_forward(stack, x0, cfactor=8)``.

Sources: Gunther et al., "Layer-parallel training of deep residual neural networks"
(SIMODS 2020); Kirby et al., "Layer-parallel training with GPU concurrency of deep
residual neural networks via nonlinear multigrid" (HPEC 2020); Falgout et al.,
"Parallel time integration with multigrid" (SISC 2014); XBraid and TorchBraid.
"""

from parlearn.serial_chain.multigrid.cost import (
    _ratio_row,  # noqa: F401  (private: the tests check the bench's row rules)
    bench,
    calibrate,
    cost_model,
)
from parlearn.serial_chain.multigrid.layer_parallel import (
    LayerParallelResNet,
    SerialResNet,
    _forward_step,  # noqa: F401  (private: the tests count the calls it sees)
    mgrit_adjoint,
    mgrit_forward,
    parameter_grads,
    serial_adjoint,
    train_digits,
)
from parlearn.serial_chain.multigrid.solver import (
    RELAX,
    ConvergenceWarning,
    MGRITResult,
    exact_iterations,
    mgrit,
    residual,
)
from parlearn.serial_chain.multigrid.speed import cal_reading, plot_speed, read_above, speed_sweep
from parlearn.serial_chain.multigrid.stack import ResidualStack, conv_tanh, dense_tanh, random_stack

__all__ = ["ResidualStack", "dense_tanh", "conv_tanh", "random_stack", "MGRITResult",
           "ConvergenceWarning", "mgrit", "residual", "exact_iterations", "mgrit_forward",
           "mgrit_adjoint", "serial_adjoint", "parameter_grads", "LayerParallelResNet",
           "SerialResNet", "train_digits", "cost_model", "calibrate", "bench", "RELAX",
           "speed_sweep", "plot_speed", "read_above", "cal_reading"]
