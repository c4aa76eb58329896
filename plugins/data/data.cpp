// The shipped data plugin: `text`, `fashion_mnist` and `tokens`.
#include "data.hpp"

TESSERA_PLUGIN(data, TESSERA_VERSION, tessera::data::text_entry(), tessera::data::fashion_mnist_entry(),
               tessera::data::tokens_entry());
