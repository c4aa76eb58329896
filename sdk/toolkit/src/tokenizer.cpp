#include "tessera/toolkit/tokenizer.hpp"

namespace tessera::toolkit {

Tokenizer::~Tokenizer() = default;

}  // namespace tessera::toolkit
