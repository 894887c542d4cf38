// The thread count of the OpenMP runtime the kernels run on (Paddle's libiomp5, which oneDNN's
// calls bind to as well; libgomp where Paddle has none), for the engine's wide steps
// (fastdeploy/platforms/cpu_binding.py): plain C functions that ctypes calls.
#include <omp.h>

extern "C" {
// Intel / LLVM OpenMP extensions, absent from libgomp: weak, so null there.
int kmp_get_blocktime(void) __attribute__((weak));
void kmp_set_blocktime(int msec) __attribute__((weak));

int fd_omp_get_max_threads() { return omp_get_max_threads(); }

// For the calling thread's next parallel regions (the engine's main thread starts them all).
void fd_omp_set_num_threads(int n) { omp_set_num_threads(n); }

// How long (ms) the workers of the calling thread's next teams spin before they sleep; -1: the
// runtime has no such setting.
int fd_omp_get_blocktime() { return kmp_get_blocktime != nullptr ? kmp_get_blocktime() : -1; }

void fd_omp_set_blocktime(int msec) {
  if (kmp_set_blocktime != nullptr) kmp_set_blocktime(msec);
}
}
