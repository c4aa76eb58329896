// The shipped data plugin: `text` and `fashion_mnist`.
#include "data.hpp"

TESSERA_PLUGIN(data, TESSERA_VERSION, tessera::data::text_entry(), tessera::data::fashion_mnist_entry());
