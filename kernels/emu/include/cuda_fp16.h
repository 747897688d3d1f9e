// Stand-in for the CUDA toolkit's header under the host emulator: cuda_emu.h defines __half.
#pragma once
#include "../cuda_emu.h"
