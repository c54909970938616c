// pdl.cuh — Programmatic Dependent Launch (PDL) primitives for the discrete path's __global__ wrappers only
// (discrete/launch.py launches them with programmatic stream serialization; the megakernel never includes this).
//
// Rule for every wrapper that may be launched with PDL: before qmk_pdl_wait() it touches only data no kernel
// writes (weights, scales, slice tables); every read of an activation / state / control-block buffer and every
// write comes after it. Launched without the attribute, both instructions are no-ops, so they are unconditional.
#pragma once

// Block until the predecessor grid has completed and its memory operations are visible to this grid (PTX
// griddepcontrol.wait = cudaGridDependencySynchronize). Also orders: a compiler memory barrier.
__device__ __forceinline__ void qmk_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Allow the dependent grid to be scheduled once every block of this grid has executed this (or exited)
// (cudaTriggerProgrammaticLaunchCompletion). Scheduling only: the dependent's own wait still waits for this
// grid's completion, so it is safe anywhere; issued first thing, so a dependent can occupy SMs as ours free up.
__device__ __forceinline__ void qmk_pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Bring the 128-byte line holding p into L2 (no register result; weights only — never a buffer a predecessor
// may still write).
__device__ __forceinline__ void qmk_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Every wrapper's first statement: let the successor be scheduled, then wait for the predecessor.
__device__ __forceinline__ void qmk_pdl_enter() {
    qmk_pdl_launch_dependents();
    qmk_pdl_wait();
}
