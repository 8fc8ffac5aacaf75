// The one Catch2 implementation unit (compiled once, unoptimised).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
