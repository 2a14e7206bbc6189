// Layout transforms around the expert-parallel collectives. After the EP AlltoAll a rank holds
// R blocks (one per peer) of [El, C, M]: its El experts' slots from each peer. The experts want
// their rows together, [El, R*C, M]; the combine goes back the other way. Pure copies of
// contiguous [C, M] rows, so both are exact inverses.
#include <string.h>

#include "moert.h"

void rt_expert_major(const float *x, float *y, int blocks, int experts, int64_t rows, int64_t m) {
  int64_t chunk = rows * m;  // one block's slots of one expert
  for (int r = 0; r < blocks; r++)
    for (int e = 0; e < experts; e++)
      memcpy(y + ((int64_t)e * blocks + r) * chunk, x + ((int64_t)r * experts + e) * chunk, sizeof(float) * (size_t)chunk);
}

void rt_rank_major(const float *x, float *y, int blocks, int experts, int64_t rows, int64_t m) {
  int64_t chunk = rows * m;
  for (int r = 0; r < blocks; r++)
    for (int e = 0; e < experts; e++)
      memcpy(y + ((int64_t)r * experts + e) * chunk, x + ((int64_t)e * blocks + r) * chunk, sizeof(float) * (size_t)chunk);
}

void rt_scale(float *x, int64_t n, float s) {
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}
