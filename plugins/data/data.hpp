#pragma once
// The entries of the shipped data plugin (see data.cpp).
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::data {
sdk::PluginEntry text_entry();
sdk::PluginEntry fashion_mnist_entry();
sdk::PluginEntry tokens_entry();
}  // namespace tessera::data
