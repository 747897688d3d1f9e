// Stand-in for the CUDA toolkit's header under the host emulator: cuda_emu.h defines __nv_bfloat16.
#pragma once
#include "../cuda_emu.h"
