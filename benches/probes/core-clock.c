// The core clock, from a chain of dependent integer adds (one a cycle): the rate the probes beside it divide by.
//
//   gcc -O2 benches/probes/core-clock.c -o /tmp/core-clock && /tmp/core-clock
#include <stdio.h>
#include <time.h>
int main(){ struct timespec a,b; unsigned long n=2000000000UL, x=0;
clock_gettime(CLOCK_MONOTONIC,&a);
for(unsigned long i=0;i<n;i++){ __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x)); }
clock_gettime(CLOCK_MONOTONIC,&b);
double t=(b.tv_sec-a.tv_sec)+(b.tv_nsec-a.tv_nsec)*1e-9; printf("%.2f GHz (x=%lu)\n", 4.0*n/t/1e9, x); }
