auto s = R"x(a" // b\
)x"; int n = 1'000; // c \
x = 1;
#define A 1 /*
*/ B
