// Process-wide knobs shared by all gmm_* variants (experiment only).
#include <cstddef>
static int g_raster_order = 1;  // 0 = Heuristic (resolves to AlongN when host shapes are absent), 1 = AlongM, 2 = AlongN

extern "C" int gmm_raster_order_get() { return g_raster_order; }
extern "C" int gmm_set_raster_order(int r) {
  if (r < 0 || r > 2) return -1;
  g_raster_order = r;
  return 0;
}
